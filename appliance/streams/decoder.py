"""Decoders: a camera (RTSP, HTTP MJPEG, a file, a V4L2 device) opened and read as
packets, each decoded into frames, a frame turned into RGB pixels only when it will be
inferred (a frame skipped to keep the stream's rate costs its decode, not its
conversion).

A decoder is a function ``StreamConfig -> Source``, chosen by the stream's
``decoder`` field from :data:`DECODERS`. The built-in one is PyAV (FFmpeg's
demuxers and software decoders, in binary wheels for x86-64 and aarch64: the
``streams`` extra). On Jetson the hardware decoder is reached through GStreamer
(``nvv4l2decoder``): docs/vision.md shows the pipeline a GStreamer ``Source`` runs.

Everything here blocks: the stream's decoder thread calls it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from appliance.config.streams_config import StreamConfig


class Source(Protocol):
    """An opened camera."""

    def frames(self) -> Iterator[tuple[Any, float]]:
        """Decoded frames and the seconds each packet took to decode; ends when the
        source does (the end of a file, a camera that closed the connection); raises
        when it fails (a timeout, a broken stream)."""
        ...

    def rgb(self, frame: Any) -> np.ndarray:
        """The frame's pixels, (height, width, 3) uint8 RGB."""
        ...

    def close(self) -> None: ...


class PyAVSource:
    """A source read by PyAV (imported here, when a stream first opens)."""

    def __init__(self, config: StreamConfig) -> None:
        import av  # the streams extra; imported when a stream opens

        self._av = av
        options: dict[str, str] = {}
        fmt: str | None = None
        if config.kind == "rtsp":
            options = {"rtsp_transport": "tcp", "fflags": "nobuffer"}
        elif config.kind == "mjpeg":
            fmt = "mpjpeg"  # multipart/x-mixed-replace over HTTP, as IP cameras serve it
        elif config.kind == "v4l2":
            fmt = "v4l2"
        wait = config.open_timeout_s
        self.container = av.open(config.url, format=fmt, options=options, timeout=(wait, wait))
        try:
            video = self.container.streams.video
            if not video:
                raise ValueError(f"{config.url} has no video stream")
            self.stream = video[0]
        except BaseException:
            self.container.close()
            raise

    def frames(self) -> Iterator[tuple[Any, float]]:
        for packet in self.container.demux(self.stream):
            started = time.perf_counter()
            decoded = packet.decode()
            spent = time.perf_counter() - started
            for frame in decoded:
                yield frame, spent

    def rgb(self, frame: Any) -> np.ndarray:
        return frame.to_ndarray(format="rgb24")  # type: ignore[no-any-return]

    def close(self) -> None:
        self.container.close()


DECODERS: dict[str, Callable[[StreamConfig], Source]] = {"pyav": PyAVSource}


def available(name: str) -> str:
    """Why the decoder ``name`` cannot run here, or "" when it can."""
    if name == "pyav":
        try:
            import av  # noqa: F401
        except ImportError:
            return "PyAV is not installed: pip install 'appliance[streams]'"
    return ""
