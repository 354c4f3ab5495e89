"""OpenVINO backend: compile settings, one compiled model per instance group, IR
files, static batch reshaping, devices, and serving through the appliance.

The contract cases every backend shares are in test_backend_conformance.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from appliance import InProcessServer, backends
from appliance.backends.base import BackendOptions, TensorSpec
from appliance.errors import ApplianceError, Code
from devtools import modelgen

ov = pytest.importorskip("openvino", reason="not installed: pip install 'appliance[openvino]'")

from appliance.backends.openvino_backend import OpenVinoSettings, settings  # noqa: E402


def _options(path: Path = Path("/r/m/1/model.xml"), **kw: object) -> BackendOptions:
    return BackendOptions(path, **kw)  # type: ignore[arg-type]


# ---- settings (pure) -------------------------------------------------------------------


def test_one_instance_is_latency_several_are_throughput_on_one_compiled_model() -> None:
    one = settings(_options(threads=4))
    assert one == OpenVinoSettings("CPU", "LATENCY", 1, 4, 0, "f32")
    three = settings(_options(instance_count=3, threads=2))
    assert (three.hint, three.requests, three.threads) == ("THROUGHPUT", 3, 6)
    props = three.properties()
    assert props["PERFORMANCE_HINT"] == "THROUGHPUT"
    assert props["PERFORMANCE_HINT_NUM_REQUESTS"] == "3"
    assert props["INFERENCE_NUM_THREADS"] == "6"
    assert props["ENABLE_CPU_PINNING"] == "NO"
    assert props["INFERENCE_PRECISION_HINT"] == "f32"


def test_device_comes_from_parameters_or_the_instance_kind() -> None:
    assert settings(_options(kind="KIND_GPU")).device == "GPU"
    auto = settings(_options(kind="KIND_AUTO"))
    assert auto.device == "AUTO"
    # CPU-only properties are not sent to other devices; their precision is their default
    assert set(auto.properties()) == {"PERFORMANCE_HINT", "PERFORMANCE_HINT_NUM_REQUESTS"}
    params = {
        "device": "auto:GPU,CPU",
        "PERFORMANCE_HINT": "cumulative_throughput",
        "num_streams": "2",
        "inference_precision": "BF16",
        "INFERENCE_NUM_THREADS": "3",
    }
    s = settings(_options(parameters=params))
    assert s == OpenVinoSettings("AUTO:GPU,CPU", "CUMULATIVE_THROUGHPUT", 1, 3, 2, "bf16")
    assert s.properties()["NUM_STREAMS"] == "2"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"performance_hint": "FAST"}, "parameters.performance_hint: expected one of"),
        ({"num_streams": "two"}, "parameters.num_streams: expected an integer >= 0, got 'two'"),
        ({"inference_precision": "int4"}, "parameters.inference_precision: expected one of"),
    ],
)
def test_invalid_parameters_name_the_model_and_parameter(
    params: dict[str, str], message: str
) -> None:
    with pytest.raises(ApplianceError) as bad:
        settings(_options(parameters=params))
    assert bad.value.code == Code.INVALID_ARG
    assert bad.value.message.startswith("model 'm': ") and message in bad.value.message


# ---- loading -------------------------------------------------------------------------------


def _write(folder: Path, data: bytes, name: str = "model.onnx") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def _ir(folder: Path, onnx_bytes: bytes, batch: int | None) -> Path:
    """Save the model as IR (model.xml + model.bin), its first dim fixed to ``batch``."""
    proto = onnx.load_from_string(onnx_bytes)
    if batch is not None:
        for value in [*proto.graph.input, *proto.graph.output]:
            value.type.tensor_type.shape.dim[0].dim_value = batch
    folder.mkdir(parents=True, exist_ok=True)
    model = ov.Core().read_model(proto.SerializeToString(), b"")
    ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)
    return folder / "model.xml"


def test_an_instance_group_shares_one_compiled_model(tmp_path: Path) -> None:
    path = _write(tmp_path / "mlp" / "1", modelgen.mlp())

    def make(i: int, group: str) -> backends.Backend:
        return backends.create(
            "openvino",
            BackendOptions(path, instance_index=i, instance_count=2, share_group=group),
        )

    a, b = make(0, "copy1"), make(1, "copy1")
    other = make(0, "copy2")  # a hot swap's new copy never shares with the old one
    try:
        assert a.compiled_model is b.compiled_model  # type: ignore[attr-defined]
        assert other.compiled_model is not a.compiled_model  # type: ignore[attr-defined]
        compiled = a.compiled_model  # type: ignore[attr-defined]
        assert str(compiled.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
        x = np.ones((2, 256), np.float32)
        np.testing.assert_array_equal(
            a.infer({"input": x}, ["output"])["output"], b.infer({"input": x}, ["output"])["output"]
        )
        a.close()
        # the survivor keeps the compiled model alive
        assert b.infer({"input": x}, ["output"])["output"].shape == (2, 16)
    finally:
        b.close()
        other.close()
    again = make(0, "copy1")  # the last close freed it: a new load compiles anew
    try:
        assert again.compiled_model is not compiled  # type: ignore[attr-defined]
    finally:
        again.close()


def test_static_batch_ir_is_reshaped_when_the_config_batches(tmp_path: Path) -> None:
    path = _ir(tmp_path / "m" / "1", modelgen.mlp(), batch=1)
    static = backends.create("openvino", BackendOptions(path))
    assert static.inputs == [TensorSpec("input", "FP32", (1, 256))]
    static.close()
    b = backends.create("openvino", BackendOptions(path, max_batch_size=4))
    try:
        assert b.inputs == [TensorSpec("input", "FP32", (-1, 256))]
        assert b.outputs == [TensorSpec("output", "FP32", (-1, 16))]
        x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
        ref = backends.create(
            "onnxruntime", BackendOptions(_write(tmp_path / "r" / "1", modelgen.mlp()))
        )
        want = ref.infer({"input": x}, ["output"])["output"]
        ref.close()
        np.testing.assert_allclose(
            b.infer({"input": x}, ["output"])["output"], want, rtol=1e-4, atol=1e-6
        )
    finally:
        b.close()


def test_a_static_batch_other_than_one_is_refused_with_how_to_fix_it(tmp_path: Path) -> None:
    path = _ir(tmp_path / "m" / "1", modelgen.mlp(), batch=2)
    with pytest.raises(ApplianceError) as refused:
        backends.create("openvino", BackendOptions(path, max_batch_size=4))
    message = refused.value.message
    assert refused.value.code == Code.INVALID_ARG
    assert "input 'input' has the static shape [2,256]" in message
    assert "set max_batch_size: 0" in message


def test_ir_needs_its_weights_file(tmp_path: Path) -> None:
    path = _ir(tmp_path / "m" / "1", modelgen.mlp(), batch=None)
    path.with_suffix(".bin").unlink()
    with pytest.raises(ApplianceError, match=r"model 'm': model.xml needs model.bin next to it"):
        backends.create("openvino", BackendOptions(path))


def test_auto_device_runs_and_a_missing_device_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "m" / "1", modelgen.simple_add_sub())
    auto = backends.create("openvino", BackendOptions(path, parameters={"device": "AUTO"}))
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(
        auto.infer({"INPUT0": a, "INPUT1": a}, ["OUTPUT0"])["OUTPUT0"], 2 * a
    )
    auto.close()
    missing = [d for d in ("NPU", "GPU") if d not in ov.Core().available_devices]
    if not missing:
        pytest.skip("this machine has every device")
    with pytest.raises(ApplianceError) as bad:
        backends.create("openvino", BackendOptions(path, parameters={"device": missing[0]}))
    assert (
        f"OpenVINO device '{missing[0]}' is not available here; available: [" in bad.value.message
    )


def test_missing_openvino_fails_the_load_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "m" / "1", modelgen.mlp())
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino -> ImportError
    monkeypatch.delitem(sys.modules, "appliance.backends.openvino_backend", raising=False)
    with pytest.raises(ApplianceError) as bad:
        backends.create("openvino", BackendOptions(path))
    assert bad.value.code == Code.INVALID_ARG
    assert (
        "backend 'openvino' needs a package that is not installed (openvino)" in bad.value.message
    )
    assert "pip install 'appliance[openvino]'" in bad.value.message


# ---- through the appliance ----------------------------------------------------------------

OV_MLP = """\
backend: openvino
default_model_filename: model.onnx
max_batch_size: 8
dynamic_batching: {max_queue_delay_microseconds: 2000}
instance_group: [{count: 2, kind: KIND_CPU}]
"""


def test_served_by_the_appliance(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    modelgen.write_model(repo, "ov_mlp", modelgen.mlp(), OV_MLP)
    modelgen.write_model(repo, "ort_mlp", modelgen.mlp())
    _ir(repo / "ir_static" / "1", modelgen.mlp(), batch=1)  # found by model.xml, no config
    _ir(repo / "ir_batched" / "1", modelgen.mlp(), batch=1)
    (repo / "ir_batched" / "config.yaml").write_text("max_batch_size: 4\n")
    modelgen.write_model(
        repo,
        "ov_strings",
        modelgen.identity("BYTES", [2]),
        "backend: openvino\ndefault_model_filename: model.onnx\n",
    )
    rows = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32)

    async def main() -> None:
        async with InProcessServer(repo) as server:
            states = {m["name"]: m for m in server.index()}
            assert states["ov_strings"]["state"] == "UNAVAILABLE"
            assert "string tensors are not supported" in states["ov_strings"]["reason"]
            assert server.metadata("ir_static")["inputs"][0]["shape"] == [1, 256]
            assert server.metadata("ir_batched")["inputs"][0]["shape"] == [-1, 256]
            assert server.metadata("ov_mlp")["platform"] == ""
            # six concurrent single-row requests, batched over two instances
            got = await asyncio.gather(
                *(server.infer("ov_mlp", {"input": rows[i : i + 1]}) for i in range(6))
            )
            want = await server.infer("ort_mlp", {"input": rows})
            ov_rows = np.concatenate([g["output"] for g in got])
            np.testing.assert_allclose(ov_rows, want["output"], rtol=1e-4, atol=1e-5)
            three = await server.infer("ir_batched", {"input": rows[:3]})
            np.testing.assert_allclose(three["output"], want["output"][:3], rtol=1e-4, atol=1e-5)
            one = await server.infer("ir_static", {"input": rows[:1]})
            np.testing.assert_allclose(one["output"], want["output"][:1], rtol=1e-4, atol=1e-5)
            stats = server.statistics("ov_mlp")["model_stats"][0]
            assert stats["inference_count"] == 6

    asyncio.run(main())


def test_an_output_keeps_its_name_when_openvino_inlines_an_if(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    config = "backend: openvino\ndefault_model_filename: model.onnx\nmax_batch_size: 4\n"
    modelgen.write_model(repo, "ov_if", modelgen.inlined_if(), config)
    # a config naming the output (as a Triton user writes it) is served by that name too
    declared = config + "output: [{name: output, data_type: TYPE_FP32, dims: [1]}]\n"
    modelgen.write_model(repo, "ov_if_declared", modelgen.inlined_if(), declared)
    modelgen.write_model(repo, "ort_if", modelgen.inlined_if())
    compiled = ov.Core().compile_model(str(repo / "ov_if" / "1" / "model.onnx"), "CPU")
    assert compiled.outputs[0].get_any_name() != "output"  # what the backend must not use
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def main() -> None:
        async with InProcessServer(repo) as server:
            want = (await server.infer("ort_if", {"input": rows}))["output"]
            np.testing.assert_allclose(want, rows.mean(axis=1, keepdims=True))
            for name in ("ov_if", "ov_if_declared"):
                assert server.metadata(name)["outputs"][0]["name"] == "output"
                got = await server.infer(name, {"input": rows})
                np.testing.assert_allclose(got["output"], want, rtol=1e-6)

    asyncio.run(main())


def test_a_load_error_keeps_openvinos_whole_reason(tmp_path: Path, caplog) -> None:
    # ops OpenVINO has no conversion rule for, with long names: its report names them
    # all and ends with its summary, far past 300 characters
    ops = [f"UnconvertibleOperationNumber{i}WithAVeryLongName" for i in range(12)]
    nodes = [
        onnx.helper.make_node(op, [f"t{i}"], [f"t{i + 1}"], domain="com.example")
        for i, op in enumerate(ops)
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info(f"t{len(ops)}", onnx.TensorProto.FLOAT, [1, 4])],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", 17),
            onnx.helper.make_opsetid("com.example", 1),
        ],
    )
    model.ir_version = modelgen.IR_VERSION
    config = "backend: openvino\ndefault_model_filename: model.onnx\n"
    modelgen.write_model(tmp_path, "unconvertible", model.SerializeToString(), config)

    async def main() -> str:
        async with InProcessServer(tmp_path) as server:
            (entry,) = server.index()
            assert entry["state"] == "UNAVAILABLE"
            return str(entry["reason"])

    with caplog.at_level("ERROR"):
        reason = asyncio.run(main())
    assert len(reason) > 600
    assert "OpenVINO cannot read model.onnx" in reason
    assert all(f"com.example.{op}" in reason for op in ops)  # the summary, every node
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"com.example.{ops[-1]}" in logged


def test_engine_messages_are_bounded_keeping_start_and_end() -> None:
    from appliance.backends.base import MESSAGE_CHARS, engine_message

    assert engine_message(RuntimeError("  short \n")) == "short"
    long = "HEAD " + "x" * (3 * MESSAGE_CHARS) + " Summary: Conv-16"
    bounded = engine_message(long)
    assert bounded.startswith("HEAD ") and bounded.endswith("Summary: Conv-16")
    assert len(bounded) < MESSAGE_CHARS + 100 and "characters left out" in bounded
