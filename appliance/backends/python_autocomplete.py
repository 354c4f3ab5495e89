"""A Python model's ``auto_complete_config`` (Triton's): the model fills in its own
config before it is built, so a ``model.py`` with no ``config.pbtxt`` (or one that
leaves tensors out) declares its inputs, outputs and batch size itself.

The model's ``TritonPythonModel.auto_complete_config(config)`` gets a
:class:`AutoCompleteConfig` over the config as loaded (Triton's JSON form) and
returns it; what it added becomes the tensors the backend declares, which the
loader's completion (:mod:`appliance.config.completion`) turns into the model's
config, as it does with an engine's graph.
"""

from __future__ import annotations

import copy
from typing import Any

from appliance import datatypes
from appliance.datatypes import TensorSpec
from appliance.errors import invalid


class AutoCompleteConfig:
    """Triton's ``pb_utils.ModelConfig`` as ``auto_complete_config`` receives it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = copy.deepcopy(config)
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._config)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = dict(policy)

    def add_input(self, tensor: dict[str, Any]) -> None:
        self._add("input", tensor)

    def add_output(self, tensor: dict[str, Any]) -> None:
        self._add("output", tensor)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"auto_complete_config: an {kind} needs a 'name'")
        if any(t.get("name") == name for t in self._config[kind]):
            raise invalid(f"auto_complete_config: {kind} '{name}' already exists")
        self._config[kind].append(dict(tensor))


def complete(cls: Any, config: dict[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The tensors ``cls.auto_complete_config`` declares over ``config`` (batch dim -1
    where the batch size it sets, or the config's, is above 0)."""
    done = cls.auto_complete_config(AutoCompleteConfig(config))
    if not isinstance(done, AutoCompleteConfig):
        raise invalid("auto_complete_config must return the config it was given")
    doc = done.as_dict()
    batch = (-1,) if int(doc.get("max_batch_size") or 0) > 0 else ()

    def specs(kind: str) -> list[TensorSpec]:
        out = []
        for t in doc[kind]:
            dims = tuple(int(d) for d in t.get("dims", ()))
            datatype = datatypes.from_config_type(str(t.get("data_type", "")))
            out.append(TensorSpec(t["name"], datatype, batch + dims, bool(t.get("optional"))))
        return out

    return specs("input"), specs("output")
