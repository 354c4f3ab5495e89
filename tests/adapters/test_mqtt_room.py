"""The MQTT bridge's admission rule (appliance.adapters.mqtt.protocol.Room), without a
broker: room per connection, twice as much for QoS 1, nothing while closed."""

from __future__ import annotations

from appliance.adapters.mqtt.protocol import Room


def test_room_is_counted_per_connection_and_given_back() -> None:
    room = Room(max_pending=2)
    assert room.take(1, qos=0) == (False, False)  # not open yet: the broker keeps it
    room.open()
    assert [room.take(1, qos=0) for _ in range(3)] == [(True, True), (True, True), (True, False)]
    # a new connection has room of its own while the old one's requests finish
    assert room.take(2, qos=0) == (True, True)
    room.give_back(1)
    assert room.take(1, qos=0) == (True, True)
    room.close()
    assert room.take(3, qos=0) == (False, False)


def test_qos1_takes_the_brokers_overshoot() -> None:
    room = Room(max_pending=2)
    room.open()
    taken = [room.take(7, qos=1)[1] for _ in range(5)]
    assert taken == [True, True, True, True, False]  # up to twice max_pending
