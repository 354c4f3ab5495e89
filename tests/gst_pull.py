"""Pull frames from a GStreamer pipeline's ``appsink name=frames``: run by Debian's
python3 (python3-gi), ``python3 gst_pull.py PIPELINE COUNT``; prints one line per
frame, ``WIDTHxHEIGHT FORMAT BYTES``, and exits 1 if none come within 20 s."""

import sys

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402


def main() -> None:
    Gst.init(None)
    pipeline = Gst.parse_launch(sys.argv[1])
    sink = pipeline.get_by_name("frames")
    pipeline.set_state(Gst.State.PLAYING)
    try:
        for _ in range(int(sys.argv[2])):
            sample = sink.emit("try-pull-sample", 20 * Gst.SECOND)
            if sample is None:
                print("no frame", flush=True)
                sys.exit(1)
            caps = sample.get_caps().get_structure(0)
            size = sample.get_buffer().get_size()
            width, height = caps.get_value("width"), caps.get_value("height")
            print(f"{width}x{height} {caps.get_value('format')} {size}", flush=True)
    finally:
        pipeline.set_state(Gst.State.NULL)


if __name__ == "__main__":
    main()
