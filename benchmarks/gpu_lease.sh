#!/usr/bin/env bash
# Every GPU measurement of issue 50 in one call on one H200, within 8 minutes: the
# stages share a budget (BUDGET_S, 465 s by default), each runs under the smaller of
# its own limit and what is left, and one that fails or runs out costs only its own
# figures. Stages, most valuable first:
#
#   env            gpu_env.sh: the wheels of .whl/ (make gpu-wheels: fla-core, einops,
#                  packaging, megatron-core) into /tmp/site and hla_sp editable, offline
#   peer           gpu_peer.py: fwd+bwd of linear_attention, our kernels alone, fla's
#                  chunk_simple_gla (g_gamma, g), hla2, SDPA flash; ratios and targets
#   kernels        gpu_kernels.py: per-kernel table against fla, launches, sync check
#   megatron_*_32k Megatron-LM's loop, --attention hla2 and the same model with softmax
#                  on flash (megatron_sdpa.py), 32k tokens: tokens/s, MFU
#   train_1m       hla-sp train, one 1,048,576-token sequence (2 layers, width 512,
#                  bf16): step time and peak memory
#   layer          gpu_layer.py: one HLAttention layer against softmax
#   megatron_*_8k  the Megatron pair at 8k
#   check          bench_gpu.py --skip-timings: the kernels against the fp64 torch path
#   quality        only with QUALITY_S=seconds: the capacity study (gpu_quality.py)
#   tests          the kernel tests on CUDA, with what time is left
#   summary        gpu_summary.py: summary.json and summary.md (also printed)
#
# Usage, from the repository root:
#   OUT=dir bash benchmarks/gpu_lease.sh              on the GPU machine
#   OUT=dir bash benchmarks/gpu_lease.sh --dry-run    on a CPU: tiny shapes, the
#       interpreter or the torch path, Megatron's parser on the recorded H200 log; the
#       plumbing only (tests/integration/test_gpu_lease.py runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
OUT=${OUT:-runs/gpu_lease}
BUDGET_S=${BUDGET_S:-465}
PY=${PYTHON:-python3}
[ "$DRY" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: >"$OUT/stages.tsv"
: >"$OUT/lease.log"
export PYTHONUNBUFFERED=1 OUT
unset TRITON_INTERPRET HLA_SP_BACKEND
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/lease.log"; }

# stage NAME MAX_S CMD...: CMD under min(MAX_S, budget left), output in $OUT/NAME.log,
# one line in stages.tsv (name, exit status, seconds, limit); 124 means cut by the limit.
stage() {
    local name=$1 max=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - t0)))
    local lim=$((max < left ? max : left))
    if [ "$lim" -lt 10 ]; then
        printf '%s\tskipped\t0\t%s\n' "$name" "$max" >>"$OUT/stages.tsv"
        stamp "$name: skipped, the budget is spent"
        return 0
    fi
    local s
    s=$(date +%s)
    timeout --kill-after 5 "$lim" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - s))" "$lim" >>"$OUT/stages.tsv"
    stamp "$name: exit $rc in $(($(date +%s) - s)) s (limit $lim s)"
}

skip() { printf '%s\tskipped\t0\t0\n' "$1" >>"$OUT/stages.tsv"; stamp "$1: skipped ($2)"; }

site=/tmp/site
if [ "$DRY" = 1 ]; then
    stamp "dry run on $($PY -c 'import sys; print(sys.executable)')"
    DRYF=--dry-run
else
    DRYF=
    stage env 60 bash benchmarks/gpu_env.sh "$site" "$PY"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

stage peer 230 "$PY" benchmarks/gpu_peer.py $DRYF --out "$OUT/peer.json"
stage kernels 60 "$PY" benchmarks/gpu_kernels.py $DRYF --out "$OUT/kernels.json"

# The Megatron model: 8 layers, width 1024, 8 heads over 4 kv groups, bf16, mock data;
# 6 iterations, the first 2 warm-up. hla2 against softmax on flash, 32k then 8k tokens.
megatron() {  # NAME ATTENTION SEQ GBS MAX_S
    local spec=
    [ "$2" = softmax ] && spec="megatron_sdpa sdpa_layer_spec"
    if [ "$DRY" = 1 ]; then  # the parser, once, on the recorded H200 run (hla2, 8k, batch 4)
        [ "$1" = megatron_hla2_8k ] || { skip "$1" "dry run"; return; }
        stage "$1" 30 "$PY" benchmarks/megatron_log.py \
            --log benchmarks/results/gpu/gpu_megatron_h200.txt --out "$OUT/$1.json" \
            --attention hla2 --seq 8192 --gbs 4 --layers 8 --hidden 1024 --heads 8 \
            --kv-groups 4 --vocab 32000
        return
    fi
    stage "$1" "$5" env SITE_READY=1 ATTENTION="$2" SPEC="$spec" SEQ="$3" GBS="$4" ITERS=6 \
        LOG="$OUT/$1.raw.log" JSON="$OUT/$1.json" bash benchmarks/gpu_megatron.sh
}
megatron megatron_hla2_32k hla2 32768 1 75
megatron megatron_softmax_32k softmax 32768 1 60

if [ "$DRY" = 1 ]; then
    skip train_1m "dry run: hla-sp train is covered by the launcher's tests"
else
    # 2 layers of width 512 (4 heads of 128), no position table, bf16: about 78 GiB by
    # the launcher's memory model, which is an upper bound without recompute.
    stage train_1m 60 "$PY" -m hla_sp.launch.cli train --seq-length 1048576 \
        --micro-batch-size 1 --num-layers 2 --hidden-size 512 --num-attention-heads 4 \
        --position-embedding-type none --bf16 --train-iters 3 --lr 1e-4 \
        --lr-warmup-iters 1 --log-interval 1 --log-jsonl "$OUT/train_1m.jsonl"
fi
stage layer 45 "$PY" benchmarks/gpu_layer.py $DRYF --out "$OUT/layer.json"
megatron megatron_hla2_8k hla2 8192 4 60
megatron megatron_softmax_8k softmax 8192 4 50

# Correctness on the GPU: fp32 and bf16 against the fp64 torch path (every gradient,
# documents, initial states), and 1M tokens with B*T*H*K past 2^31 (int64 offsets).
if [ "$DRY" = 0 ]; then
    stage check 60 "$PY" benchmarks/bench_gpu.py --skip-timings --out "$OUT/check.json"
fi

# The capacity study (docs/quality.md) needs minutes of its own: only when asked for
# (QUALITY_S=seconds), with whatever budget is left.
if [ "${QUALITY_S:-0}" != 0 ] && [ "$DRY" = 0 ]; then
    stage quality "$QUALITY_S" "$PY" benchmarks/gpu_quality.py --budget-s "$QUALITY_S" \
        --out "$OUT/quality"
fi

if [ "$DRY" = 1 ]; then
    skip tests "dry run: the kernel tests run in the normal suite"
else
    # -v names each test as it starts, so a stage cut by the budget still says where.
    stage tests 150 "$PY" -m pytest -v -p no:cacheprovider --timeout 60 \
        tests/unit/kernels/test_*.py tests/unit/ops/test_compile.py tests/unit/launch/model/test_launch_cuda.py \
        tests/unit/ops/test_precision.py
fi

"$PY" benchmarks/gpu_summary.py --dir "$OUT" --budget-s "$BUDGET_S" \
    >"$OUT/summary.log" 2>&1
src=$?
cat "$OUT/summary.md" 2>/dev/null || cat "$OUT/summary.log"
stamp "done: summary exit $src"
exit "$src"
