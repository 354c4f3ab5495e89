"""Device telemetry over recorded sysfs trees (a Jetson Orin Nano, an x86 box) and over
this machine's own files; what is missing is absent, never an error."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from device_trees import JETSON, X86, recorded, writable

from appliance.telemetry import families as f
from appliance.telemetry import summary
from appliance.telemetry.device import Telemetry
from appliance.telemetry.files import cpu_list, read_int


def _values(samples: list[f.Sample], family: f.Family) -> dict[tuple[str, ...], float]:
    return {s.labels: s.value for s in samples if s.family is family}


def test_jetson_orin_nano_tree() -> None:
    telemetry = recorded(JETSON)
    assert [s.name for s in telemetry.sources] == [
        "temperatures", "throttle counters", "cpufreq", "ina3221", "devfreq gpu", "emc",
        "nvpmodel",
    ]  # fmt: skip
    samples = telemetry.read()
    temps = _values(samples, f.TEMPERATURE)
    assert temps[("cpu-thermal", "cpu", "thermal_zone")] == pytest.approx(48.531)
    assert temps[("gpu-thermal", "gpu", "thermal_zone")] == pytest.approx(47.218)
    assert temps[("tj-thermal", "junction", "thermal_zone")] == pytest.approx(48.531)
    # the power-gated CV zones cannot be read: absent, not zero
    assert not [labels for labels in temps if labels[0].startswith("cv")]
    trips = _values(samples, f.TEMPERATURE_THROTTLE)
    assert trips[("gpu-thermal", "gpu", "thermal_zone")] == 99.0  # sw-throttle, not shutdown
    assert ("tj-thermal", "junction", "thermal_zone") not in trips  # no passive trip
    # INA3221: volts x amps per named rail; "sum of shunt voltages" is not a rail
    power = _values(samples, f.POWER)
    assert power == {
        ("VDD_IN", "ina3221 1-0040"): pytest.approx(5.072 * 1.368),
        ("VDD_CPU_GPU_CV", "ina3221 1-0040"): pytest.approx(5.064 * 0.296),
        ("VDD_SOC", "ina3221 1-0040"): pytest.approx(5.064 * 0.288),
    }
    # two CPU clusters
    assert _values(samples, f.CPU_FREQUENCY) == {("0", "0-3"): 729.6e6, ("4", "4-5"): 1510.4e6}
    assert _values(samples, f.CPU_FREQUENCY_MAX)[("0", "0-3")] == 1510.4e6
    # the GPU's devfreq node (not the video engine's): load in tenths of a percent
    assert _values(samples, f.GPU_UTILIZATION) == {("17000000.gpu",): pytest.approx(0.312)}
    assert _values(samples, f.GPU_FREQUENCY) == {("17000000.gpu",): 306e6}
    assert _values(samples, f.GPU_FREQUENCY_LIMIT) == {("17000000.gpu",): 624.75e6}
    assert _values(samples, f.EMC_FREQUENCY_LIMIT) == {("nvpmodel",): 2133e6}
    assert _values(samples, f.EMC_FREQUENCY) == {}  # debugfs: root only, not in the tree
    assert _values(samples, f.POWER_MODE) == {("0", "15W"): 1.0}
    assert _values(samples, f.THROTTLE_EVENTS) == {("oc1",): 0, ("oc2",): 0, ("oc3",): 0}
    status, line = summary.summary(samples, telemetry.describe())
    assert status == "ok"
    assert "cpu 48.5 C, gpu 47.2 C" in line and "VDD_IN 6.94 W" in line
    assert "power mode 15W (id 0)" in line and "no throttling" in line


def test_x86_tree() -> None:
    telemetry = recorded(X86)
    assert [s.name for s in telemetry.sources] == [
        "temperatures", "throttle counters", "cpufreq", "rapl",
    ]  # fmt: skip
    samples = telemetry.read()
    temps = _values(samples, f.TEMPERATURE)
    assert temps[("x86_pkg_temp", "cpu", "thermal_zone")] == 41.0
    assert temps[("acpitz", "board", "thermal_zone")] == pytest.approx(27.8)
    assert temps[("coretemp Package id 0", "cpu", "hwmon")] == 41.0
    assert temps[("coretemp Core 3", "cpu", "hwmon")] == 40.0
    assert not [labels for labels in temps if labels[0].startswith("acpitz ")]  # hwmon twin
    # x86_pkg_temp's passive trip is 0 (disabled): no throttle temperature
    assert _values(samples, f.TEMPERATURE_THROTTLE) == {}
    # one counter per core (hyper-threads share it) and one per package
    assert _values(samples, f.THROTTLE_EVENTS) == {
        ("cpu_core_thermal",): 12 + 0 + 3 + 0,
        ("cpu_package_thermal",): 7,
    }
    assert len(_values(samples, f.CPU_FREQUENCY)) == 8
    assert _values(samples, f.CPU_FREQUENCY)[("2", "2")] == 4100023e3
    energy = _values(samples, f.ENERGY)
    assert energy[("package-0", "intel-rapl:0")] == pytest.approx(73210.465922)
    assert energy[("dram", "intel-rapl:0:2")] == pytest.approx(9873.219007)
    assert len(energy) == 4
    status, line = summary.summary(samples, telemetry.describe())
    assert status == "warn" and "15 cpu_core_thermal throttle events since boot" in line


def test_counters_that_move_say_the_device_throttled(tmp_path: Path) -> None:
    root = writable(JETSON, tmp_path)
    telemetry = recorded(root)
    before = telemetry.read()
    assert summary.throttled(before, telemetry.read()) == (0, [])
    oc = root / "sys/class/hwmon/hwmon3/oc3_event_cnt"
    oc.write_text("4\n")
    events, why = summary.throttled(before, telemetry.read())
    assert events == 4 and why == ["4 oc3 events"]
    # a sensor at its passive trip point throttles too
    (root / "sys/class/thermal/thermal_zone1/temp").write_text("99500\n")
    after = telemetry.read()
    assert summary.at_throttle_trip(after) == ["gpu-thermal"]
    assert summary.throttled(after, after) == (0, ["gpu-thermal at its throttle temperature"])
    assert summary.summary(after, telemetry.describe())[0] == "warn"


def test_rapl_wrap_keeps_the_counter_going_up(tmp_path: Path) -> None:
    root = writable(X86, tmp_path)
    telemetry = recorded(root)
    key = ("package-0", "intel-rapl:0")
    first = _values(telemetry.read(), f.ENERGY)[key]
    energy = root / "sys/class/powercap/intel-rapl:0/energy_uj"
    energy.write_text("1000000\n")  # wrapped past max_energy_range_uj
    after = _values(telemetry.read(), f.ENERGY)[key]
    assert after == pytest.approx((262143328850 + 1000000) / 1e6)
    assert after > first


def test_files_that_go_away_or_hold_nonsense_are_absent(tmp_path: Path) -> None:
    root = writable(JETSON, tmp_path)
    telemetry = recorded(root)
    full = len(telemetry.read())
    (root / "sys/class/thermal/thermal_zone0/temp").unlink()
    (root / "sys/devices/platform/bus@0/17000000.gpu/load").write_text("busy\n")
    shutil.rmtree(root / "sys/devices/system/cpu/cpufreq/policy4")
    (root / "var/lib/nvpmodel/status").write_text("garbage\n")
    samples = telemetry.read()
    assert ("cpu-thermal", "cpu", "thermal_zone") not in _values(samples, f.TEMPERATURE)
    assert _values(samples, f.GPU_UTILIZATION) == {}
    assert ("4", "4-5") not in _values(samples, f.CPU_FREQUENCY)
    assert _values(samples, f.POWER_MODE) == {}
    assert 0 < len(samples) < full
    assert summary.summary(samples, telemetry.describe())[0] == "ok"


def test_nothing_found_is_no_error(tmp_path: Path) -> None:
    (tmp_path / "sys/class/thermal").mkdir(parents=True)
    (tmp_path / "sys/class/hwmon/hwmon0").mkdir(parents=True)  # a chip without a name
    telemetry = Telemetry.discover(str(tmp_path))
    assert telemetry.sources == [] and telemetry.read() == []
    status, line = summary.summary([], telemetry.describe())
    assert status == "ok" and line.startswith("no device telemetry")


def test_this_machine() -> None:
    """The real files of this machine, where they exist: every readable thermal zone and
    cpufreq policy is read, with the same value the file holds."""
    telemetry = Telemetry.discover("/")
    try:
        samples = telemetry.read()
    finally:
        telemetry.close()
    assert all(s.family in f.ALL and math.isfinite(s.value) for s in samples)
    zones = Path("/sys/class/thermal")
    expected = []  # (type, degrees) of each zone whose temperature reads, in zone order
    for zone in sorted(zones.glob("thermal_zone*"), key=lambda z: int(z.name[12:])):
        value = read_int(str(zone / "temp"))
        if value is not None and (zone / "type").exists():
            expected.append(((zone / "type").read_text().strip(), value / 1000))
    read = [
        (s.labels[0], s.value)
        for s in samples
        if s.family is f.TEMPERATURE and s.labels[2] == "thermal_zone"
    ]
    assert len(read) == len(expected)
    for (sensor, value), (zone_type, degrees) in zip(read, expected, strict=True):
        assert sensor.startswith(zone_type)
        assert value == pytest.approx(degrees, abs=5)  # a live sensor moves between reads
    policies = Path("/sys/devices/system/cpu/cpufreq")
    wanted = [p for p in policies.glob("policy*") if (p / "scaling_cur_freq").exists()]
    assert len(_values(samples, f.CPU_FREQUENCY)) == len(wanted)


def test_cpu_list_format() -> None:
    assert cpu_list([0, 1, 2, 3, 6]) == "0-3,6"
    assert cpu_list([4, 5]) == "4-5"
    assert cpu_list([1, 3]) == "1,3"
    assert cpu_list([]) == ""


def test_trees_keep_their_links() -> None:
    """The recorded trees are sysfs-shaped: class entries are links into devices/."""
    link = JETSON / "sys/class/devfreq/17000000.gpu"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert (link / "device/load").read_text().strip() == "312"
    assert (X86 / "sys/devices/system/cpu/cpu5/cpufreq").is_symlink()


def test_libraries_are_only_tried_on_the_real_root() -> None:
    """NVML and jetson-stats read the running system, never a recorded tree; and NVML is
    not imported where no NVIDIA driver shows itself."""
    from appliance.telemetry.jetson_stats import Jtop
    from appliance.telemetry.nvml import Nvml, driver_present

    assert Nvml.discover(str(X86)) is None and Jtop.discover(str(JETSON)) is None
    if not driver_present("/"):
        assert Nvml.discover("/") is None
