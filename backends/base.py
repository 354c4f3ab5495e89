"""The contract every inference backend implements.

A backend knows numpy arrays and files, nothing else: no asyncio, no protocols.
One backend object is one model instance; the instance group gives it a dedicated
worker thread, so ``infer`` is only ever called from that one thread at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A model input or output as the engine declares it; -1 marks a dynamic dim."""

    name: str
    datatype: str  # KServe name: FP32, INT64, BYTES, ...
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the lifecycle tells a backend when it creates an instance."""

    model_path: Path  # the model file (or folder) inside the version directory
    instance_index: int = 0
    instance_count: int = 1
    kind: str = "KIND_CPU"
    # threads this instance may use for one inference (its share of the cores)
    threads: int = 1
    parameters: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    """One loaded copy of a model.

    Ownership: the instance group creates it on a worker thread, calls ``infer``
    only from that thread, and calls ``close`` exactly once after the last infer.
    Failure: ``__init__`` raises on a model it cannot load (an ``ApplianceError``
    or any exception, which the lifecycle reports as a load failure); ``infer``
    raises on engine errors, which fail that batch only.
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) inference and return the named outputs."""
        ...

    def close(self) -> None:
        """Release the engine's memory; the object is unusable afterwards."""
        ...
