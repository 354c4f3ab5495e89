"""What a language model's config asks of the LLM engine, read without importing it.

The ``llm`` backend (:mod:`appliance.backends.llm_backend`) serves a GGUF file or an OpenVINO
IR LLM folder with OpenVINO GenAI's continuous-batching pipeline. Its settings are
the model config's ``parameters`` (all optional):

- ``kv_cache_size``: the KV cache the pipeline may fill, in whole GiB (OpenVINO
  GenAI sizes it in GB), e.g. ``1GiB`` (the default);
- ``kv_cache_blocks``: the KV cache in the pipeline's blocks instead (finer, for
  small devices; a block holds one sequence's keys and values for a few tokens);
- ``max_num_seqs`` (8): sequences one step may batch; ``max_num_batched_tokens``
  (256): tokens one step may batch (a long prompt is split over several steps);
- ``enable_prefix_caching`` (false): reuse the KV blocks of a repeated prompt prefix;
- ``max_tokens`` (256): tokens generated when a request does not say;
  ``max_tokens_limit`` (4096): the most a request may ask for;
- ``device``: OpenVINO's device name (default: ``CPU``, ``GPU`` for ``KIND_GPU``).

The memory budget's estimate before the engine starts is the weights (the file, or
the folder's files) plus the KV cache when it is sized in GiB (:func:`estimate`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.backends.parameters import Parameters
from appliance.config.fields import ConfigError, parse_size

GiB = 2**30
DEVICES = {"KIND_CPU": "CPU", "KIND_GPU": "GPU", "KIND_AUTO": "AUTO", "KIND_MODEL": "CPU"}


@dataclass(frozen=True, slots=True)
class LlmSettings:
    model_path: str
    device: str
    kv_cache_gib: int  # 0 when the cache is sized in blocks
    kv_cache_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    max_tokens: int
    max_tokens_limit: int
    threads: int  # CPU threads of the engine; 0: OpenVINO decides

    def wire(self) -> dict[str, Any]:
        return asdict(self)


def read(
    model: str,
    path: Path,
    parameters: dict[str, str],
    kind: str = "KIND_CPU",
    threads: int = 0,
    source: str = "",
) -> LlmSettings:
    """The settings of model ``model`` (INVALID_ARG naming the parameter when wrong)."""
    p = Parameters(model, parameters)
    blocks = p.integer(("kv_cache_blocks",), 0, minimum=0)
    found = p.raw("kv_cache_size")
    size = GiB if found is None else parse_size(found[1], source, "parameters.kv_cache_size")
    if blocks and found is not None:
        raise ConfigError(source, "parameters", "set kv_cache_size or kv_cache_blocks, not both")
    if not blocks and (size <= 0 or size % GiB):
        raise ConfigError(
            source,
            "parameters.kv_cache_size",
            f"must be whole GiB (OpenVINO GenAI sizes its KV cache in GB), got {size} bytes; "
            "set kv_cache_blocks for a smaller cache",
        )
    limit = p.integer(("max_tokens_limit",), 4096, minimum=1)
    default_tokens = p.integer(("max_tokens",), 256, minimum=1)
    if default_tokens > limit:
        raise ConfigError(
            source, "parameters.max_tokens", f"{default_tokens} exceeds max_tokens_limit {limit}"
        )
    device = p.raw("device")
    return LlmSettings(
        model_path=str(path),
        device=device[1] if device else DEVICES.get(kind, "CPU"),
        kv_cache_gib=0 if blocks else size // GiB,
        kv_cache_blocks=blocks,
        max_num_seqs=p.integer(("max_num_seqs",), 8, minimum=1),
        max_num_batched_tokens=p.integer(("max_num_batched_tokens",), 256, minimum=16),
        enable_prefix_caching=p.flag(("enable_prefix_caching",), False),
        max_tokens=default_tokens,
        max_tokens_limit=limit,
        threads=threads,
    )


def weights_bytes(path: Path) -> int:
    """The model's files: a GGUF file, or every file of an IR folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def estimate(model: str, path: Path, parameters: dict[str, str], source: str = "") -> int:
    """What the memory budget expects one instance to need before it is built: the
    weights plus a KV cache sized in GiB (a cache in blocks is measured after the
    warm-up: its block size is the engine's)."""
    settings = read(model, path, parameters, source=source)
    return weights_bytes(path) + settings.kv_cache_gib * GiB
