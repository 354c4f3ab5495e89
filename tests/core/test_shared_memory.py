"""The system shared-memory registry against real POSIX shm objects."""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm

from appliance.core.shared_memory import SharedMemoryRegistry
from appliance.errors import ApplianceError, Code

SIZE = 64
_keys = itertools.count()


@pytest.fixture
def region() -> Iterator[tuple[str, shm.SharedMemoryRegion]]:
    """A fresh 64-byte POSIX shm object holding bytes 0..63; destroyed afterwards."""
    key = f"/appliance_test_{os.getpid()}_{next(_keys)}"
    handle = shm.create_shared_memory_region("r", key, SIZE)
    try:
        shm.set_shared_memory_region(handle, [np.arange(SIZE, dtype=np.uint8)])
        yield key, handle
    finally:
        shm.destroy_shared_memory_region(handle)


def error(call: object, *args: object) -> ApplianceError:
    assert callable(call)
    with pytest.raises(ApplianceError) as e:
        call(*args)
    return e.value


def test_register_status_unregister(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, SIZE)
    reg.register("b", key, 16, 32)
    assert reg.status() == [
        {"name": "a", "key": key, "offset": 0, "byte_size": SIZE},
        {"name": "b", "key": key, "offset": 16, "byte_size": 32},
    ]
    assert reg.status("b") == [{"name": "b", "key": key, "offset": 16, "byte_size": 32}]
    # the window of "b" starts at byte 16 of the object
    assert bytes(reg.view("b", 0, 4, "input 'x'")) == bytes([16, 17, 18, 19])
    reg.unregister("b")
    assert [r["name"] for r in reg.status()] == ["a"]
    assert error(reg.status, "b").code is Code.NOT_FOUND
    reg.unregister("b")  # unknown names are a no-op, as in Triton
    reg.unregister()
    assert reg.status() == []


def test_duplicate_name_is_refused(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, 8)
    exc = error(reg.register, "a", key, 8, 8)
    assert exc.code is Code.INVALID_ARG
    assert "'a' is already registered" in exc.message
    assert reg.status("a")[0]["offset"] == 0  # the first registration is untouched


def test_missing_and_malformed_keys() -> None:
    reg = SharedMemoryRegistry(enabled=True)
    exc = error(reg.register, "a", f"/appliance_missing_{os.getpid()}", 0, 8)
    assert exc.code is Code.INVALID_ARG
    assert "cannot open shared-memory key" in exc.message
    assert "No such file" in exc.message
    for key in ("", "/", "/a/b", "/..", "/.", "/a\0b"):
        assert "is not a POSIX shared-memory name" in error(reg.register, "a", key, 0, 8).message
    assert reg.status() == []


def test_register_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    assert f"exceeds the {SIZE} bytes of key" in error(reg.register, "a", key, 8, SIZE).message
    assert "exceeds" in error(reg.register, "a", key, SIZE, 1).message
    for offset, size in ((-1, 8), (0, 0), (0, -8), (True, 8), (0, 8.0)):
        exc = error(reg.register, "a", key, offset, size)
        assert "offset must be an integer >= 0 and byte_size an integer > 0" in exc.message
    assert "needs a non-empty name" in error(reg.register, "", key, 0, 8).message
    assert reg.status() == []
    reg.register("end", key, SIZE - 1, 1)  # the very last byte is fine
    assert bytes(reg.view("end", 0, 1, "x")) == bytes([SIZE - 1])


def test_view_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 16, 16)
    assert bytes(reg.view("a", 12, 4, "x")) == bytes([28, 29, 30, 31])
    assert len(reg.view("a", 16, 0, "x")) == 0
    for offset, size in ((-1, 4), (0, -1), (0, 17), (13, 4), (16, 1), (1 << 70, 1)):
        exc = error(reg.view, "a", offset, size, "input 'x'")
        assert exc.code is Code.INVALID_ARG
        assert exc.message.startswith("input 'x': ")
        assert "region 'a'" in exc.message
    assert "'nope' is not registered" in error(reg.view, "nope", 0, 1, "input 'x'").message


def test_views_are_read_only_and_zero_copy(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, handle = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, SIZE)
    view = reg.view("a", 0, 4, "x")
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    shm.set_shared_memory_region(handle, [np.full(4, 200, dtype=np.uint8)])
    assert bytes(view) == bytes([200] * 4)  # a view of the mapping, not a copy
    del view


def test_write_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, handle = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 32, 16)
    reg.write("a", 4, 8, np.full(2, -1, dtype=np.int32).data, "output 'y'")
    got = shm.get_contents_as_numpy(handle, np.uint8, [SIZE]).copy()
    assert got[36:44].tolist() == [255] * 8
    assert got[32:36].tolist() == [32, 33, 34, 35] and got[44] == 44  # neighbours untouched
    # the declared window must be inside the region and the data must fit in it
    assert "outside region 'a'" in error(reg.write, "a", 12, 8, b"\1" * 4, "o").message
    assert "outside region 'a'" in error(reg.write, "a", -1, 4, b"\1", "o").message
    exc = error(reg.write, "a", 0, 4, b"\1" * 5, "output 'y'")
    assert exc.message == (
        "output 'y': needs 5 bytes but shared_memory_byte_size is 4 in region 'a'"
    )
    assert "'b' is not registered" in error(reg.write, "b", 0, 4, b"\1", "o").message
    assert shm.get_contents_as_numpy(handle, np.uint8, [SIZE]).copy().tolist() == got.tolist()


def test_unregister_while_a_view_is_alive(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 8, 16)
    arr = np.frombuffer(reg.view("a", 0, 16, "x"), dtype=np.uint8)  # an in-flight input
    reg.unregister("a")
    reg.unregister()
    gc.collect()
    assert arr.tolist() == list(range(8, 24))  # still mapped and readable
    assert "not registered" in error(reg.view, "a", 0, 1, "x").message
    del arr
    gc.collect()  # the last view goes: the mapping is unmapped without a BufferError


def test_disabled_registry_refuses_everything(
    region: tuple[str, shm.SharedMemoryRegion],
) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=False)
    calls = [
        (reg.register, "a", key, 0, 8),
        (reg.status,),
        (reg.unregister,),
        (reg.view, "a", 0, 8, "x"),
        (reg.write, "a", 0, 8, b"\0", "x"),
        (reg.check, "a", 0, 8, "x"),
    ]
    for call, *args in calls:
        exc = error(call, *args)
        assert exc.code is Code.INVALID_ARG
        assert "set 'shared_memory: system' in the server config" in exc.message
