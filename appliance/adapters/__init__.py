"""Protocol adapters: HTTP, gRPC, MQTT, the in-process API and the metrics
exposition. Each turns its wire into core requests and back; no logic of
its own beyond decoding, encoding and access control."""
