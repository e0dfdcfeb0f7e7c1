#!/usr/bin/env bash
# Every GPU check in one call, sized for a short lease of one H200 (about 8.5 minutes of
# command time; the stages' timeouts add up to 520 s). Each stage runs whatever the one
# before it did, and writes its own log, so one failure costs only its own figures.
#
#   1. the capacity study (benchmarks/gpu_quality.py, MQAR at (512, 64)) in the background,
#      beside the kernel tests on CUDA (correctness only: sharing the GPU costs them time,
#      not truth);
#   2. benchmarks/bench_gpu.py timings, alone on the GPU;
#   3. benchmarks/gpu_megatron.sh: Megatron-LM's loop with --attention hla2, alone.
#
# Usage, from the repository root on the GPU machine:
#   OUT=dir bash benchmarks/gpu_lease.sh     (QUALITY_S=0 skips the study)
# megatron-core comes from MCORE_DIR (a `pip install --target` folder, default
# .mcore/0.19.2, which `make setup-megatron` builds) or from .whl/ (see gpu_megatron.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_lease}
QUALITY_S=${QUALITY_S:-200}
MCORE_DIR=${MCORE_DIR:-.mcore/0.19.2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHON=python3 OUT
# megatron-core for the tests that build a Megatron model, and for gpu_megatron.sh.
export PYTHONPATH="$PWD/$MCORE_DIR${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET HLA_SP_BACKEND
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/lease.log"; }

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    # The image's python holds torch; hla_sp goes beside it, editable, so that tests and
    # benchmarks import the working tree.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
    python3 -c "import hla_sp, hla_sp.launch, hla_sp.ops; print('hla_sp imports')"
} >"$OUT/lease.log" 2>&1
stamp "environment ready"

qpid=
if [ "$QUALITY_S" != 0 ]; then
    python3 benchmarks/gpu_quality.py --budget-s "$QUALITY_S" --out /tmp/gpu_quality \
        >"$OUT/quality.log" 2>&1 &
    qpid=$!
    stamp "capacity study started (budget $QUALITY_S s)"
fi
# -v names each test as it starts, so a stage cut by its timeout still says where.
timeout "${TESTS_S:-150}" python3 -m pytest -v -p no:cacheprovider --timeout 60 --durations 15 \
    tests/unit/test_kernels.py tests/unit/test_kernels_hla2.py tests/unit/test_compile.py \
    tests/unit/test_launch_cuda.py tests/unit/test_precision.py >"$OUT/tests.log" 2>&1
stamp "kernel tests: exit $?"
if [ -n "$qpid" ]; then
    wait "$qpid"
    stamp "capacity study: exit $?"
fi
cp /tmp/gpu_quality/recall_gpu.json "$OUT/" 2>/dev/null

timeout 110 python3 benchmarks/bench_gpu.py --seqlens "${SEQLENS:-8192,32768}" \
    --out "$OUT/bench_gpu.json" >"$OUT/bench_gpu.log" 2>&1
stamp "bench_gpu: exit $?"

timeout 60 python3 benchmarks/profile_gpu.py --T 32768 --out "$OUT/profile_gpu.json" \
    >"$OUT/profile_gpu.log" 2>&1
stamp "profile_gpu: exit $?"

ITERS=${ITERS:-10} GBS=${GBS:-4} LOG=/tmp/megatron.log \
    timeout 150 bash benchmarks/gpu_megatron.sh >"$OUT/megatron.log" 2>&1
stamp "gpu_megatron: exit $?"
tar czf "$OUT/extra.tgz" -C /tmp gpu_quality 2>/dev/null
stamp "done"
