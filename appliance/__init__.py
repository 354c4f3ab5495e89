"""Edge inference appliance: a Triton-compatible inference server for small devices."""

__version__ = "0.1.0"
