"""The KServe v2 JSON codec (with Triton's binary-data extension) that the HTTP and
MQTT wires share: neither wire imports the other."""
