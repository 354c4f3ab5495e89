"""What an engine says of a model file before anything runs it: which ONNX IR versions
and opsets the installed ONNX Runtime reads, an explanation a user can act on when a
model is newer than that, and :func:`probe` (``appliance doctor``): the file parsed and
checked by the engine that would serve it, without running the model.

ONNX Runtime refuses a model whose IR version it does not know ("Unsupported model IR
version: 14, max supported IR version: 11") or whose opset is newer than it
implements. Which releases read what, measured (ONNX Runtime's own error messages):

| ONNX Runtime | reads IR | opset (ai.onnx) | newest release for |
|---|---|---|---|
| 1.16.3 (the oldest this package supports; JetPack 6) | <= 9 | <= 19 | |
| 1.23.2 | <= 11 | <= 23 | Python 3.10 |
| 1.32.0 | <= 14 | <= 28 | Python >= 3.11 |

A current ``onnx`` package saves IR 14 by default; ``devtools.modelgen`` saves IR 8 and
opset 17, which every release above reads.
"""

from __future__ import annotations

import re
from pathlib import Path

from appliance.backends.base import engine_message

# (ONNX Runtime release, the newest ONNX IR version it reads, its newest ai.onnx opset,
# the Pythons it has wheels for); measured, see the module docstring
READS: tuple[tuple[str, int, int, str], ...] = (
    ("1.16.3", 9, 19, "Python 3.8-3.11"),
    ("1.23.2", 11, 23, "Python 3.10 and later"),
    ("1.32.0", 14, 28, "Python 3.11 and later"),
)
_IR = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")
_OPSET = re.compile(
    r"Opset (\d+) is under development.*?support for domain (\S*) is till opset (\d+)", re.S
)
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : (?:\S+:\d+ \S.*?\) )?")


def _newer_release(need: int, column: int, installed: str) -> str:
    """'ONNX Runtime X (Python ...) reads it', or a plain 'a newer onnxruntime'."""
    for release, ir, opset, python in READS:
        if (ir, opset)[column] >= need and _as_tuple(release) > _as_tuple(installed):
            return f"install onnxruntime >= {release} ({python}), which reads it"
    return "install a newer onnxruntime"


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def explain(message: str, installed: str) -> str | None:
    """ONNX Runtime's refusal of a model it is too old for, as what to do; None when
    ``message`` is about something else."""
    m = _IR.search(message)
    if m:
        model_ir, max_ir = int(m.group(1)), int(m.group(2))
        return (
            f"the model is ONNX IR version {model_ir}, and ONNX Runtime {installed} reads IR "
            f"<= {max_ir}: save it at IR {max_ir} or lower (with onnx: model.ir_version = "
            f"{max_ir}, then onnx.save; its opsets must be ones this runtime implements), "
            f"or {_newer_release(model_ir, 0, installed)}"
        )
    m = _OPSET.search(message)
    if m:
        opset, domain, newest = int(m.group(1)), m.group(2) or "ai.onnx", int(m.group(3))
        return (
            f"the model uses opset {opset} of {domain}, and ONNX Runtime {installed} implements "
            f"opsets <= {newest}: convert it (onnx.version_converter.convert_version(model, "
            f"{newest})) or {_newer_release(opset, 1, installed)}"
        )
    return None


def ort_message(exc: BaseException, installed: str) -> str:
    """An ONNX Runtime load error as one readable line (no C++ source location)."""
    text = " ".join(str(exc).split())
    return explain(text, installed) or engine_message(_ORT_PREFIX.sub("", text))


def probe(backend: str, path: Path) -> str:
    """'' when the engine that would serve ``path`` reads it, else why not: the graph is
    parsed and checked against the installed engine (IR version, opsets, operators),
    nothing is run. ONNX Runtime builds an unoptimized CPU session; OpenVINO reads the
    model (no compile); a Python model's source is compiled, not imported; TensorRT
    engines are not checked (deserializing one needs the GPU)."""
    try:
        if backend == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.intra_op_num_threads = 1
            options.log_severity_level = 3  # errors only: the answer is the exception
            try:
                ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except Exception as exc:  # onnxruntime's own exception types: see ort_message
                return ort_message(exc, ort.__version__)
        elif backend == "openvino":
            import openvino as ov

            ov.Core().read_model(str(path))
        elif backend == "python":
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except ImportError as exc:
        return f"the {backend} engine does not import: {exc}"
    except (SyntaxError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # the engine's refusal, whatever its type
        return engine_message(exc)
    return ""
