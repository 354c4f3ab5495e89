"""Decode JPEG/PNG bytes, resize to 224x224, normalize with ImageNet's mean and std."""

from __future__ import annotations

import io
import json
import warnings
from typing import Any

import numpy as np
from PIL import Image

from appliance import python_model as pb_utils

SIZE = (224, 224)
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)


def preprocess(data: bytes, max_pixels: int) -> np.ndarray:
    """One encoded image -> FP32 [3, 224, 224]; TritonError INVALID_ARG if it is bad."""
    try:
        with warnings.catch_warnings():
            # above max_pixels Pillow warns (and refuses at twice that): refuse at once
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                if image.format not in ("JPEG", "MPO", "PNG"):  # MPO: camera JPEGs
                    raise pb_utils.TritonError(
                        f"expected a JPEG or PNG image, got {image.format}",
                        pb_utils.TritonError.INVALID_ARG,
                    )
                rgb = image.convert("RGB").resize(SIZE, Image.Resampling.BILINEAR)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise pb_utils.TritonError(
            f"image is too large (more than {max_pixels} pixels)", pb_utils.TritonError.INVALID_ARG
        ) from None
    except Image.UnidentifiedImageError:  # Pillow's text names its BytesIO object
        raise pb_utils.TritonError(
            f"not a readable JPEG or PNG image: {len(data)} bytes in no image format "
            f"(they start {data[:8]!r})",
            pb_utils.TritonError.INVALID_ARG,
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:  # what Pillow raises for bad data
        raise pb_utils.TritonError(
            f"not a readable JPEG or PNG image: {exc}", pb_utils.TritonError.INVALID_ARG
        ) from None
    pixels = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return np.ascontiguousarray((pixels - MEAN) / STD, dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config: dict[str, Any] = json.loads(args["model_config"])
        self.max_pixels = int(config["parameters"]["max_image_pixels"]["string_value"])
        # Pillow's decompression-bomb guard is process-wide: it reads this at open()
        Image.MAX_IMAGE_PIXELS = self.max_pixels

    def execute(
        self, requests: list[pb_utils.InferenceRequest]
    ) -> list[pb_utils.InferenceResponse]:
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE")
            assert images is not None  # the server checked the request against the config
            try:
                batch = np.stack(
                    [preprocess(bytes(row[0]), self.max_pixels) for row in images.as_numpy()]
                )
            except pb_utils.TritonError as error:
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", batch)]))
        return responses
