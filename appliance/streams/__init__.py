"""Camera streams served by the appliance itself: sources decoded (``decoder``), the
newest frame of each inferred through the data plane (``stream``), detections published
(``sinks``), the set of streams started, stopped and reloaded (``manager``), and their
metrics (``metrics``). See docs/vision.md."""
