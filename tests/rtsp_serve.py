"""A real RTSP server for the stream tests: GStreamer's RTSP server serving an H.264
test pattern (videotestsrc, x264enc) at rtsp://127.0.0.1:PORT/cam.

Run by Debian's own python3 (its python3-gi and gir1.2-gst-rtsp-server-1.0, which
scripts/test.sh installs), not the test's interpreter: ``python3 rtsp_serve.py PORT``.
It prints ``ready`` once it listens and serves until it is killed."""

import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402

PIPELINE = (
    "( videotestsrc is-live=true pattern=ball ! video/x-raw,width=320,height=240,framerate=15/1"
    " ! x264enc tune=zerolatency speed-preset=ultrafast key-int-max=15 bitrate=500"
    " ! rtph264pay name=pay0 pt=96 config-interval=1 )"
)


def main() -> None:
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(sys.argv[1])
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(PIPELINE)
    factory.set_shared(True)
    server.get_mount_points().add_factory("/cam", factory)
    if server.attach(None) == 0:
        print("cannot listen", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    main()
