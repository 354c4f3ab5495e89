"""Images and detectors: uploads and frames decoded and fitted to a detector's input
(``image``), YOLO heads read into boxes (``yolo``), a configured detector run through
the data plane (``detector``). Used by the DeepStack API and the camera streams."""
