"""Device telemetry: temperatures, throttling, CPU and GPU clocks, power, power mode.

Readers of sysfs and of NVML/jetson-stats, below the adapters (no wire library): the
Prometheus collector (``adapters/metrics``) exposes their samples, ``appliance doctor``
summarises them and ``appliance perf`` says when a run throttled. Families and units
are in :mod:`appliance.telemetry.families`; discovery and reading in
:mod:`appliance.telemetry.device`.
"""
