"""Developer tools that are not part of the installed appliance: the
deterministic builders of the demo and test ONNX models."""
