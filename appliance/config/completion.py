"""Auto-complete: a model config completed from what its engine declares.

A config may leave inputs, outputs and max_batch_size out; :func:`complete` fills
them from the engine's tensors, as Triton's auto-complete does, and checks what the
config did declare against them.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.config.fields import ConfigError
from appliance.config.model_config import DynamicBatching, ModelConfig, TensorConfig
from appliance.config.sequence_config import implicit_inputs, implicit_outputs
from appliance.datatypes import TensorSpec


def _check_against(
    cfg: TensorConfig, spec: TensorSpec, batched: bool, source: str, kind: str
) -> None:
    where = f"{kind} '{cfg.name}'"
    if cfg.datatype != spec.datatype:
        raise ConfigError(
            source, where, f"config says {cfg.datatype} but the model has {spec.datatype}"
        )
    model_dims = spec.shape[1:] if batched else spec.shape
    if batched and spec.shape and spec.shape[0] not in (-1,):
        raise ConfigError(
            source,
            where,
            "max_batch_size > 0 needs a dynamic first dim, but the model's shape is "
            f"{list(spec.shape)}",
        )
    dims = cfg.model_dims
    if not spec.shape and all(d == 1 for d in dims):
        # ONNX Runtime says shape [] for a scalar and for a tensor of unknown rank alike;
        # Triton serves such a model with config dims [1] (or [1, 1]): the tensor goes
        # to the engine as the client sent it
        return
    if len(model_dims) != len(dims) or any(
        m != -1 and c != -1 and m != c for m, c in zip(model_dims, dims, strict=True)
    ):
        full = ([-1] if batched else []) + list(dims)
        raise ConfigError(
            source, where, f"config dims {full} do not match the model's shape {list(spec.shape)}"
        )


def complete(
    config: ModelConfig,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    default_max_batch_size: int,
) -> ModelConfig:
    """Fill what the config left out from the engine's declared tensors, then check
    that what the config says agrees with the model (Triton's auto-complete)."""
    max_batch = config.max_batch_size
    if max_batch is None:
        batchable = all(len(s.shape) >= 1 and s.shape[0] == -1 for s in (*inputs, *outputs))
        ranks = {s.name: len(s.shape) for s in inputs}
        # declared dims with the model's full rank state the whole shape: that is a
        # config written for max_batch_size 0 (protobuf drops an explicit 0 from pbtxt)
        full_shape = bool(config.inputs) and all(
            len(t.dims) == ranks.get(t.name, -1) for t in config.inputs
        )
        max_batch = default_max_batch_size if batchable and not full_shape else 0
    batched = max_batch > 0
    dynamic = config.dynamic_batching
    if dynamic is None and config.max_batch_size is None and batched:
        dynamic = DynamicBatching()  # Triton enables dynamic batching when it picks a batch size

    # control and state tensors are fed and kept by the sequence batcher
    inputs = [s for s in inputs if s.name not in implicit_inputs(config.sequence_batching)]
    outputs = [s for s in outputs if s.name not in implicit_outputs(config.sequence_batching)]

    def fill(
        declared: tuple[TensorConfig, ...], specs: list[TensorSpec], kind: str
    ) -> tuple[TensorConfig, ...]:
        by_name = {s.name: s for s in specs}
        if not declared:
            # still checked below: an explicit max_batch_size > 0 needs dynamic first dims
            declared = tuple(
                TensorConfig(s.name, s.datatype, s.shape[1:] if batched else s.shape, s.optional)
                for s in specs
            )
        for t in declared:
            if t.name not in by_name:
                raise ConfigError(
                    config.source,
                    f"{kind} '{t.name}'",
                    f"the model has no such {kind}; it has {sorted(by_name)}",
                )
            _check_against(t, by_name[t.name], batched, config.source, kind)
        return declared

    new_inputs = fill(config.inputs, inputs, "input")
    missing = {s.name for s in inputs} - {t.name for t in new_inputs}
    if missing:
        raise ConfigError(config.source, "input", f"the model also needs inputs {sorted(missing)}")
    return replace(
        config,
        max_batch_size=max_batch,
        inputs=new_inputs,
        outputs=fill(config.outputs, outputs, "output"),
        dynamic_batching=dynamic,
    )
