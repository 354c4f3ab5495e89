"""Triton's ``model_warmup``: the warm-up samples of a model config as typed values."""

from __future__ import annotations

from dataclasses import dataclass

from appliance import datatypes
from appliance.config.fields import ConfigError, Fields


@dataclass(frozen=True, slots=True)
class WarmupInput:
    """One input of a warm-up sample; ``dims`` exclude the batch dimension."""

    name: str
    datatype: str  # KServe name
    dims: tuple[int, ...]
    data: str  # zero | random | file
    file: str = ""  # input_data_file, relative to the model's warmup/ folder


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """Triton's ``model_warmup`` entry: run ``count`` times before the model is READY."""

    name: str
    batch_size: int
    inputs: tuple[WarmupInput, ...]
    count: int = 1


_WARMUP_DATA = ("zero_data", "random_data", "input_data_file")


def parse_warmup(f: Fields) -> WarmupSample:
    f.check_keys({"name", "batch_size", "inputs", "count"})
    name = f.text("name")
    if not name:
        raise f.fail("name", "expected a non-empty warm-up sample name")
    inputs = f.sub("inputs")
    if inputs is None or not inputs.data:
        raise f.fail("inputs", "expected a mapping of input names to warm-up data")
    parsed = []
    for key, value in inputs.data.items():
        i = Fields(f.source, value, inputs.at(str(key)))
        i.check_keys({"data_type", "dims", *_WARMUP_DATA})
        raw_type = i.text("data_type")
        try:
            datatype = datatypes.from_config_type(raw_type)
        except ValueError:
            raise i.fail("data_type", f"expected a Triton data type, got {raw_type!r}") from None
        given = [k for k in _WARMUP_DATA if i.data.get(k) not in (None, False, "")]
        if len(given) != 1:
            raise ConfigError(
                f.source, i.path, f"expected exactly one of {', '.join(_WARMUP_DATA)}"
            )
        data = {"zero_data": "zero", "random_data": "random", "input_data_file": "file"}[given[0]]
        if data != "file" and i.data[given[0]] is not True:
            raise i.fail(given[0], f"expected true, got {i.data[given[0]]!r}")
        file = i.file_name("input_data_file") if data == "file" else ""
        parsed.append(WarmupInput(str(key), datatype, i.ints("dims", 0), data, file))
    return WarmupSample(
        name,
        # protobuf leaves 0 out; Triton treats a missing batch size and count as 1
        max(1, f.integer("batch_size", 1)),
        tuple(parsed),
        max(1, f.integer("count", 1)),
    )
