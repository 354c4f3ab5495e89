"""The MQTT v5 wire: the bridge (requests on topics, answers on response topics), its
packets, link and client, and the codec over the shared KServe JSON codec."""
