"""Triton's ``ensemble_scheduling``: the steps of an ensemble as typed values."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.fields import Fields


@dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One step of Triton's ``ensemble_scheduling``: which model runs, and how its
    tensor names map to the ensemble's (``input_map``: model input -> ensemble tensor,
    ``output_map``: model output -> ensemble tensor)."""

    model_name: str
    model_version: int  # -1: the newest ready version
    input_map: dict[str, str]
    output_map: dict[str, str]


def _string_map(f: Fields, key: str) -> dict[str, str]:
    value = f.data.get(key, {})
    if (
        not isinstance(value, dict)
        or not value
        or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items())
    ):
        raise f.fail(key, f"expected a non-empty mapping of tensor names, got {value!r}")
    return dict(value)


def parse_ensemble_steps(f: Fields) -> tuple[EnsembleStep, ...]:
    """``ensemble_scheduling`` for platform ``ensemble`` (and only for it)."""
    is_ensemble = f.data.get("platform") == "ensemble"
    scheduling = f.sub("ensemble_scheduling")
    if scheduling is None:
        if is_ensemble:
            raise f.fail("ensemble_scheduling", "platform 'ensemble' needs ensemble_scheduling")
        return ()
    if not is_ensemble:
        raise f.fail("ensemble_scheduling", "only a model with platform 'ensemble' has steps")
    scheduling.check_keys({"step"})
    steps = []
    for s in scheduling.entries("step"):
        s.check_keys({"model_name", "model_version", "input_map", "output_map"})
        model = s.file_name("model_name", "model name")
        if not model:
            raise s.fail("model_name", "expected the name of the model this step runs")
        steps.append(
            EnsembleStep(
                model,
                s.integer("model_version", -1, minimum=-1),
                _string_map(s, "input_map"),
                _string_map(s, "output_map"),
            )
        )
    if not steps:
        raise scheduling.fail("step", "expected at least one step")
    return tuple(steps)
