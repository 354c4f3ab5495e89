"""Discrete NVIDIA GPUs through NVML (``nvidia-ml-py``), imported only where a driver is.

Discovery imports ``pynvml`` only when the NVIDIA driver shows itself
(``/proc/driver/nvidia/version`` or ``/dev/nvidia0``) and the module is installed (the
``tensorrt`` extra brings it); Jetson has no NVML and uses devfreq instead
(:mod:`appliance.telemetry.jetson`). Each value is one NVML call (microseconds); a call
the GPU does not support is left out.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any

from appliance.telemetry import families as f

log = logging.getLogger(__name__)

# clock event (throttle) reason bits, as in nvml.h's nvmlClocksEventReason*
THROTTLE_REASONS = (
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
)


def driver_present(root: str) -> bool:
    return any(
        os.path.exists(os.path.join(root, p)) for p in ("proc/driver/nvidia/version", "dev/nvidia0")
    )


class Nvml:
    name = "nvml"

    def __init__(self, nvml: Any, handles: list[tuple[str, Any]]) -> None:
        self.nvml = nvml
        self.handles = handles  # (gpu label, device handle)

    @classmethod
    def discover(cls, root: str) -> Nvml | None:
        if root != "/" or not driver_present(root) or importlib.util.find_spec("pynvml") is None:
            return None
        try:
            nvml: Any = importlib.import_module("pynvml")
            nvml.nvmlInit()
            handles = [
                (str(i), nvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(nvml.nvmlDeviceGetCount())
            ]
        except Exception as exc:  # NVMLError and friends: no NVML here, not an error
            log.debug("NVML not available: %s", exc)
            return None
        return cls(nvml, handles) if handles else None

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, name)(*args)
        except Exception:  # not supported on this GPU, or the call failed this time
            return None

    def read(self, out: list[f.Sample]) -> None:
        nv = self.nvml
        for gpu, h in self.handles:
            util = self._call("nvmlDeviceGetUtilizationRates", h)
            if util is not None:
                out.append(f.Sample(f.GPU_UTILIZATION, (gpu,), util.gpu / 100))
            clock = self._call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)
            if clock is not None:
                out.append(f.Sample(f.GPU_FREQUENCY, (gpu,), clock * 1e6))
            top = self._call("nvmlDeviceGetMaxClockInfo", h, nv.NVML_CLOCK_SM)
            if top is not None:
                out.append(f.Sample(f.GPU_FREQUENCY_LIMIT, (gpu,), top * 1e6))
            temp = self._call("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)
            if temp is not None:
                out.append(f.Sample(f.TEMPERATURE, (f"gpu{gpu}", "gpu", "nvml"), float(temp)))
            power = self._call("nvmlDeviceGetPowerUsage", h)
            if power is not None:
                out.append(f.Sample(f.POWER, (f"gpu{gpu}", "nvml"), power / 1000))
            energy = self._call("nvmlDeviceGetTotalEnergyConsumption", h)
            if energy is not None:
                out.append(f.Sample(f.ENERGY, (f"gpu{gpu}", "nvml"), energy / 1000))
            reasons = self._call("nvmlDeviceGetCurrentClocksEventReasons", h)
            if reasons is None:  # nvidia-ml-py before 12.535 names it "throttle reasons"
                reasons = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h)
            if reasons is not None:
                for bit, reason in THROTTLE_REASONS:
                    active = 1.0 if reasons & bit else 0.0
                    out.append(f.Sample(f.GPU_THROTTLE, (gpu, reason), active))

    def describe(self) -> str:
        return f"NVML ({len(self.handles)} GPUs)"

    def close(self) -> None:
        self._call("nvmlShutdown")
