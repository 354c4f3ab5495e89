"""Images in, model tensors out: decoding an uploaded JPEG/PNG with Pillow (its size
read from the header and refused before any pixel is decoded: a decompression bomb
never reaches memory), and fitting an RGB frame to a detector's square input
(letterbox), with the transform that maps boxes back to the frame's pixels.

Blocking work (decode, resize): callers run it on a worker thread."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from appliance.errors import invalid

if TYPE_CHECKING:  # Pillow loads with the first image: a server without vision never does
    from PIL import Image

FORMATS = ("JPEG", "PNG", "BMP", "WEBP")  # what an upload may be
PAD = 114  # the grey Ultralytics pads with


@dataclass(frozen=True, slots=True)
class Fit:
    """How a frame was fitted to the input: input pixel = frame pixel * scale + pad."""

    scale: float
    pad_x: float
    pad_y: float
    width: int  # the frame's size
    height: int

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        """``boxes`` (n, 4: x1, y1, x2, y2 in input pixels) in the frame's pixels,
        clipped to the frame."""
        out = np.empty_like(boxes)
        out[:, 0::2] = (boxes[:, 0::2] - self.pad_x) / self.scale
        out[:, 1::2] = (boxes[:, 1::2] - self.pad_y) / self.scale
        np.clip(out[:, 0::2], 0, self.width, out=out[:, 0::2])
        np.clip(out[:, 1::2], 0, self.height, out=out[:, 1::2])
        return out


def decode(data: bytes | bytearray | memoryview, max_pixels: int) -> Image.Image:
    """An uploaded image as RGB. Refused (INVALID_ARG) when it is not an image of
    :data:`FORMATS`, when its header declares more than ``max_pixels`` (before it is
    decoded), or when its data is broken."""
    from PIL import Image

    if not data:
        raise invalid("the 'image' field is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise invalid(
            f"the image declares more than {Image.MAX_IMAGE_PIXELS} pixels (a decompression bomb?)"
        ) from None
    except Exception as exc:  # UnidentifiedImageError, a broken header...
        raise invalid(f"'image' is not a JPEG, PNG, BMP or WebP image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise invalid(
            f"the image is {width}x{height} ({width * height} pixels); "
            f"this server decodes at most {max_pixels} (vision.max_image_pixels)"
        )
    if width < 1 or height < 1:
        raise invalid(f"the image is {width}x{height}: no pixels")
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as exc:  # truncated or corrupt data
        raise invalid(f"the image data is broken: {exc}") from None


def fit(frame: Image.Image | np.ndarray, size: int, letterbox: str) -> tuple[np.ndarray, Fit]:
    """``frame`` (RGB) scaled to fit a ``size`` square, keeping its aspect, and padded
    (centered, or right and bottom with ``corner``): the HWC uint8 input and its
    :class:`Fit`."""
    from PIL import Image

    image = frame if isinstance(frame, Image.Image) else Image.fromarray(frame, "RGB")
    width, height = image.size
    scale = min(size / width, size / height)
    new_w, new_h = max(1, round(width * scale)), max(1, round(height * scale))
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    if letterbox == "center":
        pad_x, pad_y, fill = (size - new_w) // 2, (size - new_h) // 2, PAD
    else:
        pad_x, pad_y, fill = 0, 0, 0
    canvas = np.full((size, size, 3), fill, np.uint8)
    canvas[pad_y : pad_y + new_h, pad_x : pad_x + new_w] = np.asarray(image)
    return canvas, Fit(scale, pad_x, pad_y, width, height)


def to_input(hwc: np.ndarray, datatype: str, channels_first: bool) -> np.ndarray:
    """The fitted uint8 frame as one batch row of the model's input: NCHW (or NHWC),
    FP32/FP16 scaled to 0..1, or UINT8 as is."""
    if channels_first:
        hwc = hwc.transpose(2, 0, 1)
    if datatype == "UINT8":
        return np.ascontiguousarray(hwc)[None]
    dtype = np.float16 if datatype == "FP16" else np.float32
    out = np.empty((1, *hwc.shape), dtype)
    np.multiply(hwc, dtype(1 / 255), out=out[0], casting="unsafe")
    return out
