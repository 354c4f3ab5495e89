"""``appliance perf`` and ``appliance tune``: measuring and tuning a KServe v2 server.

- :mod:`appliance.perf.workload`: what to send (input tensors: random, zeros, files);
- :mod:`appliance.perf.transports`: how to send it (HTTP binary, gRPC, system shared
  memory, MQTT, the in-process API) with requests prebuilt once per sample;
- :mod:`appliance.perf.plan`: a run's settings and the transport prepared for them;
- :mod:`appliance.perf.workers`: the same load from several processes;
- :mod:`appliance.perf.runner`: closed-loop concurrency and open-loop Poisson load,
  a measured window after warm-up, latency percentiles and the server's statistics;
- :mod:`appliance.perf.report`: the live table, CSV, JSON and the optional plot;
- :mod:`appliance.perf.command`: the ``appliance perf`` command line;
- :mod:`appliance.perf.tune`: the ``appliance tune`` search.
"""
