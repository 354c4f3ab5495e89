#!/usr/bin/env bash
# GPU check for the TensorRT backend and ONNX Runtime's GPU execution providers.
#
# Run it on a machine with an NVIDIA GPU (Jetson or x86) where TensorRT 10 and pycuda
# are installed (pip install -e '.[test,tensorrt]'; on Jetson TensorRT comes with
# JetPack). It
#   1. prints the GPU, driver and library versions;
#   2. runs the GPU test cases that CI skips: the TensorRT conformance cases, engine
#      build + cache + FP16 + profile limits, and ONNX Runtime's CUDA provider (if
#      onnxruntime-gpu is installed);
#   3. builds TensorRT engines (FP32, FP16) from the classifier test model, serves them
#      through the appliance (in-process, dynamic batching), compares their outputs
#      with ONNX Runtime on the CPU and measures throughput at concurrency 16
#      (benchmarks/gpu_check.py), writing benchmarks/results/<date>-gpu.md.
# Exits non-zero if any step fails. Takes a few minutes (engine builds dominate).
set -euo pipefail
cd "$(dirname "$0")/.."
out="benchmarks/results/$(date +%F)-gpu.md"

echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null \
    || echo "nvidia-smi not available (Jetson: use tegrastats)"
python3 -c 'import tensorrt, pycuda.driver as c; c.init(); print("TensorRT", tensorrt.__version__, "| GPUs:", c.Device.count())'

echo "== GPU test cases (skipped on CI)"
python3 -m pytest -q -rs tests/backends/test_tensorrt_backend.py tests/backends/test_onnxruntime_backend.py \
    "tests/backends/test_backend_conformance.py" -k "tensorrt or cuda or provider or engine or fp16"

echo "== serve a TensorRT engine through the appliance, compare with the CPU, throughput"
python3 benchmarks/gpu_check.py --seconds "${GPU_CHECK_SECONDS:-10}" --out "$out"
echo "figures written to $out"
