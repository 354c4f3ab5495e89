"""The ``llm`` backend's settings and its place in the memory budget: a language model
too big for the budget is refused before its engine starts, like any model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import llm_models
import pytest

from appliance.backends import estimate, llm_settings
from appliance.config.fields import ConfigError
from appliance.config.reader import parse_config_text


def test_settings_defaults_and_kv_cache_forms(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x" * 1000)
    plain = llm_settings.read("m", model, {})
    assert (plain.kv_cache_gib, plain.kv_cache_blocks, plain.device) == (1, 0, "CPU")
    assert (plain.max_tokens, plain.max_tokens_limit, plain.max_num_seqs) == (256, 4096, 8)
    assert llm_settings.read("m", model, {"kv_cache_size": "2GiB"}).kv_cache_gib == 2
    blocks = llm_settings.read("m", model, {"kv_cache_blocks": "64"}, kind="KIND_GPU")
    assert (blocks.kv_cache_gib, blocks.kv_cache_blocks, blocks.device) == (0, 64, "GPU")
    with pytest.raises(ConfigError, match="whole GiB"):
        llm_settings.read("m", model, {"kv_cache_size": "100MiB"})
    with pytest.raises(ConfigError, match="not both"):
        llm_settings.read("m", model, {"kv_cache_size": "1GiB", "kv_cache_blocks": "8"})
    with pytest.raises(ConfigError, match="exceeds max_tokens_limit"):
        llm_settings.read("m", model, {"max_tokens": "100", "max_tokens_limit": "50"})
    # the budget's estimate before the engine starts: the weights plus a GiB-sized cache
    assert estimate("llm", model, {}) == 1000 + 2**30
    assert estimate("llm", model, {"kv_cache_blocks": "64"}) == 1000
    folder = tmp_path / "ir"
    folder.mkdir()
    (folder / "openvino_model.bin").write_bytes(b"y" * 300)
    (folder / "openvino_model.xml").write_bytes(b"z" * 20)
    assert llm_settings.weights_bytes(folder) == 320


def test_a_model_too_big_for_the_budget_is_refused(run_appliance: Any, tmp_path: Path) -> None:
    # 94 MiB of weights and the default KV cache of 1 GiB: refused by its estimate,
    # before an engine process starts
    repo = llm_models.write_repository(tmp_path, config="backend: llm\n")
    with pytest.raises(ConfigError) as refused:
        run_appliance(repo, memory_limit="512MiB")
    message = str(refused.value)
    assert "model 'smollm': one instance (estimated) needs 1117.8 MiB" in message
    assert "the memory budget is 512.0 MiB" in message


def _docs_block(language: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "llm.md").read_text()
    (block,) = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    return block


def test_the_docs_config_is_read_as_it_says(tmp_path: Path) -> None:
    config = parse_config_text(_docs_block("yaml"), "config.yaml", "smollm", "docs/llm.md")
    assert config.backend == "llm"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    settings = llm_settings.read("smollm", model, dict(config.parameters))
    assert (settings.kv_cache_blocks, settings.max_num_seqs, settings.max_tokens) == (64, 8, 256)


def test_a_gguf_model_bundles_for_ota_as_the_llm_backend(tmp_path: Path) -> None:
    pytest.importorskip("tuf", reason="the ota extra is not installed")
    from appliance.ota import bundle

    model = tmp_path / "smollm"
    (model / "3").mkdir(parents=True)
    (model / "3" / "model.gguf").write_bytes(b"GGUF" + bytes(1000))  # bundled, not loaded
    (model / "config.yaml").write_text('parameters:\n  kv_cache_blocks: "64"\n')
    manifest = bundle.build(model, 3, tmp_path / "smollm-3.tar")
    assert manifest.backend == "llm"
    assert bundle.inspect(tmp_path / "smollm-3.tar").backend == "llm"


def test_a_file_the_engine_cannot_read_fails_its_load(run_appliance: Any, tmp_path: Path) -> None:
    pytest.importorskip("openvino_genai", reason="the llm extra is not installed")
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.gguf").write_bytes(b"GGUF" + bytes(4096))
    (tmp_path / "broken" / "config.yaml").write_text('parameters:\n  kv_cache_blocks: "8"\n')
    server = run_appliance(tmp_path)
    (row,) = server.server.dataplane.repository_index()
    assert row["state"] == "UNAVAILABLE"
    assert "model 'broken': the LLM engine could not load it" in row["reason"], row
