"""Class probabilities -> the top-k as Triton classification strings "score:index:label"."""

from __future__ import annotations

import numpy as np

from appliance import python_model as pb_utils

TOP_K = 5


def top_k(probs: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """[batch, classes] -> BYTES [batch, k], the most likely class first."""
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=object)
    for r, row in enumerate(order):
        out[r] = [f"{probs[r, i]:f}:{i}:class_{i}".encode() for i in row]
    return out


class TritonPythonModel:
    def execute(
        self, requests: list[pb_utils.InferenceRequest]
    ) -> list[pb_utils.InferenceResponse]:
        responses = []
        for request in requests:
            probs = pb_utils.get_input_tensor_by_name(request, "PROBS")
            assert probs is not None  # the server checked the request against the config
            labels = pb_utils.Tensor("LABELS", top_k(probs.as_numpy()))
            responses.append(pb_utils.InferenceResponse([labels]))
        return responses
