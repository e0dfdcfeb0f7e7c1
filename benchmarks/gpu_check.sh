#!/usr/bin/env bash
# GPU check of the Triton kernels on one GPU (sized for an H200: under 8 minutes; the
# timeouts below add up to 7.5).
#   1. the kernel tests on CUDA (tests/unit/kernels/test_*.py run on the GPU when it exists);
#   2. benchmarks/bench_gpu.py: correctness in fp32 and bf16 against the fp64 torch
#      path, then fwd+bwd timings of linear_attention, hla2, hla2_fused, flash SDPA and
#      (if it imports) fla's chunk_simple_gla at B=1, H=16, K=V=128, T=8k/32k/128k;
#   3. with 2 or more GPUs, benchmarks/bench_layer_overhead.py under torchrun (NCCL): the
#      fixed cost per layer under context parallelism.
# Usage: benchmarks/gpu_check.sh [out.json]     (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-runs/bench/gpu_check.json}
unset TRITON_INTERPRET HLA_SP_BACKEND

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -c "import triton; print('triton', triton.__version__)"
# fla is optional: use it when present; try to install it, but never fail on that.
if ! "$PY" -c "import fla" 2>/dev/null; then
  timeout 30 "$PY" -m pip install -q --retries 0 --timeout 5 fla-core 2>/dev/null \
    || echo "fla-core not installed; chunk_simple_gla is skipped"
fi

start=$(date +%s)
status=0
# A test failure is reported, but the timings still run: both are worth having.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/kernels/test_kernels.py tests/unit/kernels/test_hla2_fused.py \
  tests/unit/ops/test_compile.py tests/unit/launch/model/test_launch_cuda.py \
  tests/unit/ops/test_precision.py || status=1
timeout 300 "$PY" benchmarks/bench_gpu.py --out "$OUT" || status=1
# The fixed cost per layer under context parallelism: one GPU per rank, NCCL, so only
# where there are at least two GPUs (the one-GPU lease cannot run it).
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
    benchmarks/bench_layer_overhead.py --device cuda --t-local 2048,8192 --layers 24 \
    --d-model 1024 --heads 8 --reps 5 --out "$(dirname "$OUT")" --name layer_overhead_gpu \
    || status=1
else
  echo "per-layer fixed cost under CP: needs 2 or more GPUs, this machine has $ngpu"
fi
echo "gpu_check: done in $(( $(date +%s) - start )) s, status $status; results in $OUT"
exit $status
