"""``appliance perf`` against real servers: every transport, outputs, refusals, ceiling.

Points are tiny (0.1 s warm-up, 0.4 s window that also waits for 5 requests sent in it,
so a loaded machine never leaves a point empty): the tests check that figures are sane
and files well formed, never how fast anything is.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mosquitto import Broker, Client, require_mosquitto
from PIL import Image

from appliance import cli
from appliance.errors import ApplianceError
from appliance.perf import report
from appliance.perf.command import Settings, new_loop
from appliance.perf.httpclient import Admin
from appliance.perf.runner import Point, measure, parse_range
from appliance.perf.transports import HttpTransport
from appliance.perf.window import COUNT_WINDOW_MAX_S, Window
from appliance.perf.workload import TensorSpec, make_samples, parse_shapes

FAST = ["--warmup", "0.1", "--duration", "0.4", "--measurement-request-count", "5", "--quiet"]


def test_ranges_and_shapes() -> None:
    assert parse_range("1:32:2x") == [1, 2, 4, 8, 16, 32]
    assert parse_range("1:10:4") == [1, 5, 9, 10]  # the end is always measured
    assert parse_range("2,4,8") == [2, 4, 8]
    assert parse_range("3") == [3]
    assert parse_range("1:3") == [1, 2, 3]
    for bad in ("0", "a:b", "1:8:1x", "1:8:0", "", "-2", "1:2:3:4"):
        with pytest.raises(ApplianceError, match="--concurrency"):
            parse_range(bad)
    assert parse_shapes(["x:3,224,224", "name:with:colon:4"]) == {
        "x": (3, 224, 224),
        "name:with:colon": (4,),
    }
    with pytest.raises(ApplianceError, match="--shape"):
        parse_shapes(["x:-1"])


def test_samples_random_zeros_and_files(tmp_path: Path) -> None:
    spec = TensorSpec("x", "FP32", (2, 3))
    rand = make_samples([spec], "random", count=3)
    assert len(rand) == 3 and rand[0]["x"].shape == (2, 3) and rand[0]["x"].dtype == np.float32
    assert not make_samples([spec], "zeros")[0]["x"].any()
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float64))
    from_file = make_samples([spec], "files", tmp_path)
    assert from_file[0]["x"].dtype == np.float32 and from_file[0]["x"][1, 2] == 5
    with pytest.raises(ApplianceError, match="needs --input-files"):
        make_samples([spec], "files")
    with pytest.raises(ApplianceError, match="no file"):
        make_samples([TensorSpec("y", "INT32", (1,))], "files", tmp_path)


def _perf(tmp_path: Path, *args: str) -> tuple[int, list[dict[str, str]], dict[str, Any]]:
    out_csv, out_json = tmp_path / "p.csv", tmp_path / "p.json"
    rc = cli.main(["perf", *args, *FAST, "--csv", str(out_csv), "--json", str(out_json)])
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    return rc, rows, json.loads(out_json.read_text())


def _sane(row: dict[str, str], batch: int = 1) -> None:
    assert int(row["requests"]) > 0 and int(row["errors"]) == 0, row
    assert float(row["throughput_infer_s"]) > 0
    p50, p90, p99 = (float(row[k]) for k in ("p50_ms", "p90_ms", "p99_ms"))
    assert 0 < p50 <= p90 <= p99 <= float(row["max_ms"])
    assert float(row["throughput_infer_s"]) == pytest.approx(float(row["throughput_req_s"]) * batch)
    assert int(row["server_requests"]) > 0  # the statistics extension was read
    assert float(row["server_compute_infer_us"]) > 0
    assert json.loads(row["errors_by_kind"]) == {}


@pytest.mark.parametrize("transport", ["http", "grpc", "shm"])
def test_sweep_over_network_transports(run_appliance, tmp_path, transport) -> None:
    srv = run_appliance(None, shared_memory="system")
    rc, rows, doc = _perf(
        tmp_path, "-m", "simple", "-u", srv.url, "--grpc-url", srv.grpc_url,
        "-i", transport, "-b", "2", "--concurrency", "1:4:2x",
    )  # fmt: skip
    assert rc == 0, rows  # the rows say which point failed, and how
    assert [int(r["concurrency"]) for r in rows] == [1, 2, 4]
    for row in rows:
        assert row["transport"] == transport
        _sane(row, batch=2)
    assert doc["settings"]["transport"] == transport and len(doc["points"]) == 3
    assert doc["machine"]["cores"] == os.cpu_count()
    if transport == "shm":  # the regions were unregistered and removed afterwards
        status = asyncio.run(_get(srv.url, "/v2/systemsharedmemory/status"))
        assert status == []
        assert not list(Path("/dev/shm").glob(f"appliance-perf-{os.getpid()}-*"))


async def _get(url: str, path: str) -> Any:
    admin = Admin(url)
    try:
        return await admin.get_json(path)
    finally:
        await admin.close()


# an open loop's arrivals in a (bounded) window cannot reach this many outstanding: on a
# loaded machine a client that fell behind sends its late arrivals in a burst, and the
# default 256 would turn that burst into "client: outstanding limit" errors
UNREACHABLE = ["--max-outstanding", "20000"]


def test_open_loop_and_in_process(tmp_path: Path) -> None:
    rates = ["--request-rate", "100,200", *UNREACHABLE]
    rc, rows, _ = _perf(tmp_path, "-m", "simple", "-i", "inprocess", *rates)
    assert rc == 0, rows
    assert [float(r["request_rate"]) for r in rows] == [100, 200]
    for row in rows:
        _sane(row)
        assert int(row["concurrency"]) == 0


def test_a_counting_window_counts_what_was_sent_inside_it() -> None:
    window = Window.opening(10.0, 1.0, min_fresh=2)
    window.done(9.0, 9.5)  # before the planned opening: never counted
    window.done(9.8, 10.2)  # held until the window opens (a worker learns it late)
    window.open(10.1)  # the statistics at its start were read by then
    assert window.latencies == [pytest.approx(0.4)]
    assert window.fresh == 0  # sent before the window opened: not in the server's figures
    window.failed("HTTP 503: busy", 10.5, 10.3)
    window.done(10.6, 10.9)
    assert window.errors == {"HTTP 503: busy": 1} and window.fresh == 2
    assert window.until == pytest.approx(11.1)  # enough before the nominal end: closes there
    window.done(11.0, 11.2)
    assert len(window.latencies) == 2 and window.seconds == pytest.approx(1.0)

    late = Window(0.0, 1.0, min_fresh=1)
    late.done(-0.5, 0.5)  # completed inside, but sent before it opened
    assert late.until == 1.0 + COUNT_WINDOW_MAX_S  # still waiting for one sent inside
    late.done(1.5, 2.0)
    assert late.until == 2.0 and late.seconds == 2.0 and len(late.latencies) == 2
    late.done(2.1, 2.2)  # after it closed
    assert len(late.latencies) == 2

    timed = Window(0.0, 1.0)  # no count: exactly the duration
    timed.done(0.5, 1.5)
    assert timed.latencies == [] and timed.seconds == 1.0


def test_a_counting_window_lasts_until_its_requests_completed(tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    args = ["perf", "-m", "simple", "-i", "inprocess", "--warmup", "0", "--duration", "0.001",
            "--measurement-request-count", "200", "--quiet", "--csv", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    [row] = list(csv.DictReader(io.StringIO(out.read_text())))
    assert int(row["requests"]) >= 200 and int(row["server_requests"]) >= 200
    assert cli.main(["perf", "-m", "simple", "--measurement-request-count", "-1"]) == 2


def test_load_from_several_processes(run_appliance, tmp_path) -> None:
    srv = run_appliance(None)
    rc, rows, doc = _perf(
        tmp_path, "-m", "simple", "-u", srv.url, "--processes", "2", "--concurrency", "1,3"
    )
    assert rc == 0 and doc["settings"]["processes"] == 2, rows
    assert [int(r["concurrency"]) for r in rows] == [1, 3]  # c=1: one worker stays idle
    for row in rows:
        _sane(row)
    rc, rows, _ = _perf(tmp_path, "-m", "simple", "-u", srv.url, "--processes", "2",
                        "--request-rate", "100", *UNREACHABLE)  # fmt: skip
    assert rc == 0, rows
    _sane(rows[0])
    assert cli.main(["perf", "-m", "simple", "-i", "inprocess", "--processes", "2", *FAST]) == 2


def test_json_data_over_http(run_appliance, tmp_path) -> None:
    srv = run_appliance(None)
    rc, rows, _ = _perf(tmp_path, "-m", "simple", "-u", srv.url, "--json-data")
    assert rc == 0, rows
    _sane(rows[0])


def test_jpeg_folder_feeds_a_bytes_input(run_appliance, tmp_path) -> None:
    frames = tmp_path / "frames"
    frames.mkdir()
    for i, colour in enumerate(("red", "blue")):
        Image.new("RGB", (64, 48), colour).save(frames / f"{i}.jpg", "JPEG")
    srv = run_appliance(None)
    rc, rows, _ = _perf(
        tmp_path, "-m", "image_classifier", "-u", srv.url, "--input-data", "files",
        "--input-files", str(frames), "--concurrency", "2",
    )  # fmt: skip
    assert rc == 0, rows
    assert int(rows[0]["requests"]) > 0 and int(rows[0]["errors"]) == 0


def test_refusals_are_counted_by_kind(run_appliance, tmp_path) -> None:
    srv = run_appliance(None)

    async def scenario() -> tuple[Point, Point]:
        bogus = HttpTransport(srv.url, "simple")
        await bogus.open([{"BOGUS": np.zeros((1, 16), np.int32)}], 2)
        point = Point("http", "simple", 1, concurrency=2)
        unknown = await measure(bogus, point, 1, 0.05, 0.3, min_requests=3)
        await bogus.close()
        s = Settings("simple", srv.url)
        good = HttpTransport(srv.url, "simple")
        samples = make_samples(
            [TensorSpec(n, "INT32", (1, 16)) for n in ("INPUT0", "INPUT1")], "zeros"
        )
        await good.open(samples, 2)
        admin = Admin(s.url)
        await admin.post("/v2/repository/models/simple/unload")
        point = Point("http", "simple", 1, concurrency=2)
        gone = await measure(good, point, 1, 0.05, 0.3, min_requests=3)
        await admin.post("/v2/repository/models/simple/load")
        await admin.close()
        await good.close()
        return unknown, gone

    loop = new_loop()
    try:
        unknown, gone = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert unknown.requests == 0 and unknown.errors >= 3  # the window waited for 3
    [(kind, count)] = unknown.errors_by_kind.items()
    assert kind.startswith("HTTP 400: ") and "BOGUS" in kind and count == unknown.errors
    assert gone.requests == 0 and gone.errors >= 3
    assert all(k.startswith(("HTTP 400", "HTTP 404", "HTTP 503")) for k in gone.errors_by_kind)
    # the CLI exits 1 when requests failed, and 2 for a model the server does not have
    assert cli.main(["perf", "-m", "nope", "-u", srv.url, *FAST]) == 2


def test_ceiling_against_the_trivial_server(tmp_path: Path) -> None:
    rc, rows, _ = _perf(tmp_path, "--ceiling", "--concurrency", "1,4")
    assert rc == 0, rows
    assert [int(r["concurrency"]) for r in rows] == [1, 4]
    assert all(int(r["requests"]) > 0 and int(r["errors"]) == 0 for r in rows)
    assert all(float(r["client_cpu_us_per_req"]) > 0 for r in rows)


def test_csv_and_plot_helpers(tmp_path: Path) -> None:
    p = Point("http", "m", 1, concurrency=3, requests=5, errors_by_kind={"HTTP 400: x": 2})
    rows = list(csv.DictReader(io.StringIO(report.to_csv([p]))))
    assert rows[0]["concurrency"] == "3" and json.loads(rows[0]["errors_by_kind"]) == {
        "HTTP 400: x": 2
    }
    drawn = report.plot([p], tmp_path / "p.png", "t")
    assert drawn == (tmp_path / "p.png").is_file()


def test_mqtt_transport(run_appliance, tmp_path) -> None:
    binary = require_mosquitto()
    broker = Broker(binary, tmp_path / "broker")
    (tmp_path / "broker").mkdir()
    broker.start()
    try:
        prefix, device = f"perf{os.getpid()}", "dev1"
        mqtt = {"host": "127.0.0.1", "port": broker.port, "device_id": device,
                "topic_prefix": prefix}  # fmt: skip
        srv = run_appliance(None, mqtt=mqtt)
        watcher = Client(broker.port)
        try:
            watcher.subscribe(f"{prefix}/{device}/status")
            assert any(r.payload == b"online" for r in watcher.collect(1, timeout=15))
        finally:
            watcher.close()
        rc, rows, _ = _perf(
            tmp_path, "-m", "simple", "-u", srv.url, "-i", "mqtt", "--concurrency", "2",
            "--mqtt-broker", f"127.0.0.1:{broker.port}", "--mqtt-prefix", prefix,
            "--mqtt-device", device,
        )  # fmt: skip
        assert rc == 0, rows
        _sane(rows[0])
    finally:
        broker.stop()


def test_a_run_during_which_the_device_throttled_says_so(run_appliance, tmp_path, capsys) -> None:
    from device_trees import JETSON, recorded, writable

    srv = run_appliance(None)
    metrics = f"127.0.0.1:{srv.server.metrics_port}"
    root = writable(JETSON, tmp_path)
    srv.server.telemetry.sources = recorded(root).sources
    rc, rows, doc = _perf(tmp_path, "-m", "simple", "-u", srv.url, "--metrics-url", metrics)
    assert rc == 0, rows
    assert rows[0]["throttled"] == "False" and rows[0]["throttle_events"] == "0"
    assert doc["points"][0]["max_temp_celsius"] == pytest.approx(48.531)
    assert "throttled" not in capsys.readouterr().err
    # the GPU sits at its throttle trip point (99 C) for this run
    (root / "sys/class/thermal/thermal_zone1/temp").write_text("99250\n")
    rc, rows, doc = _perf(tmp_path, "-m", "simple", "-u", srv.url, "--metrics-url", metrics)
    assert rc == 0, rows
    assert rows[0]["throttled"] == "True"
    assert rows[0]["throttle_reasons"] == "gpu-thermal at its throttle temperature"
    assert "the device throttled during c=1 (gpu-thermal" in capsys.readouterr().err
    # a server without telemetry (or no metrics endpoint): unknown, not "no"
    srv.server.telemetry.sources = []
    rc, rows, doc = _perf(tmp_path, "-m", "simple", "-u", srv.url, "--metrics-url", metrics)
    assert rc == 0, rows
    assert rows[0]["throttled"] == "" and doc["points"][0]["throttled"] is None


def test_throttle_counters_moving_during_a_window_mark_the_point(tmp_path) -> None:
    from device_trees import JETSON, recorded, writable

    from appliance.perf.runner import finish

    root = writable(JETSON, tmp_path)
    telemetry = recorded(root)
    before = {"device": telemetry.read()}
    (root / "sys/class/hwmon/hwmon3/oc2_event_cnt").write_text("3\n")
    point = Point("http", "m", 1, concurrency=2)
    point = finish(point, Window(0, 1), 0.0, before, {"device": telemetry.read()})
    assert point.throttled is True and point.throttle_events == 3
    assert point.throttle_reasons == "3 oc2 events"
    assert report.throttle_warning([point]) == (
        "the device throttled during c=2 (3 oc2 events): those figures are below what it "
        "does cool"
    )
