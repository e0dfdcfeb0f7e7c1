#!/usr/bin/env bash
# Megatron-LM's training loop with HLA (hla2) on one GPU: 20 iterations on mock data,
# then the loss and the throughput. Budget: under 8 minutes on one H200.
#
#   bash benchmarks/gpu_megatron.sh            # from the repository root, on the GPU machine
#   ITERS=20 SEQ=8192 LAYERS=8 HIDDEN=1024 bash benchmarks/gpu_megatron.sh
#   ATTENTION=softmax SPEC="megatron_sdpa sdpa_layer_spec" bash benchmarks/gpu_megatron.sh
#       (the same model with causal softmax attention on flash: benchmarks/megatron_sdpa.py)
#   JSON=out.json ...   also writes tokens/s and MFU by the linear-attention-aware FLOP
#       count (benchmarks/megatron_log.py); SITE_READY=1 skips the wheel install below
#       (gpu_lease.sh has done it).
#
# megatron.training ships with megatron-core >= 0.17 (Python >= 3.12). A machine without
# it gets it as a wheel: `make gpu-wheels` (on a machine with pip access) downloads
# megatron-core, fla-core and their small pure-Python requirements into .whl/
# (gitignored); carry `.whl` to the machine; this script installs every wheel it finds
# there into /tmp/site. Nothing is downloaded by this script, and it needs no network.
set -euo pipefail

ITERS=${ITERS:-20}
SEQ=${SEQ:-8192}
LAYERS=${LAYERS:-8}
HIDDEN=${HIDDEN:-1024}
HEADS=${HEADS:-8}
KV_GROUPS=${KV_GROUPS:-4}
MBS=${MBS:-1}
GBS=${GBS:-8}
VOCAB=${VOCAB:-32000}
ATTENTION=${ATTENTION:-hla2}
SPEC=${SPEC:-}
LOG=${LOG:-${OUT:-/tmp}/gpu_megatron.log}
JSON=${JSON:-}

cd "$(dirname "$0")/.."
site=/tmp/site
mkdir -p "$site"
if [ -z "${SITE_READY:-}" ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl
    fi
    # hla_sp itself (its package-dir mapping puts megatron_patch/ at hla_sp.megatron_patch).
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target "$site" . >/dev/null
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
spec_args=()
if [ -n "$SPEC" ]; then
    read -r -a spec_args <<<"--spec $SPEC"
    export PYTHONPATH="$PWD/benchmarks:$PYTHONPATH"   # the --spec module lives there
fi
hla_args=()
[ "$ATTENTION" != softmax ] && hla_args=(--hla-decay learned --hla-chunk-size 64)

python3 - <<'EOF'
import importlib, sys
for name in ("torch", "megatron.core", "megatron.training", "hla_sp.megatron_patch"):
    try:
        m = importlib.import_module(name)
        print(f"{name:24s} {getattr(m, '__version__', '')}")
    except ImportError as e:
        sys.exit(f"{name} does not import ({e}); see the wheel step at the top of this script")
import torch
print("gpu:", torch.cuda.get_device_name(0))
EOF

# Megatron >= 0.19 asserts that NVTE_* agree with --attention-backend (default auto), and
# --transformer-impl local uses no TE attention: leave them unset.
export CUDA_DEVICE_MAX_CONNECTIONS=1
unset NVTE_FLASH_ATTN NVTE_FUSED_ATTN NVTE_UNFUSED_ATTN
start=$(date +%s)
set +e
torchrun --standalone --nproc-per-node 1 -m hla_sp.megatron_patch.pretrain_gpt \
    --attention "$ATTENTION" "${hla_args[@]}" "${spec_args[@]}" \
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size $((4 * HIDDEN)) \
    --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$KV_GROUPS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --position-embedding-type learned_absolute --normalization RMSNorm \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --attention-dropout 0 --hidden-dropout 0 \
    --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion \
    --no-persist-layer-norm \
    --mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB" --split 1,0,0 \
    --eval-iters 0 --eval-interval 100000 --log-interval 1 --log-throughput \
    2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
echo "wall: $(( $(date +%s) - start )) s, exit status $rc"
grep -m1 -e "HLA attention in" -e "softmax core attention:" "$LOG" \
    || echo "no 'HLA attention in' line: the model check did not run"
# Megatron logs one line per iteration: "... lm loss: X | ... elapsed time per iteration (ms): Y".
awk -v seq="$SEQ" -v gbs="$GBS" '
    /elapsed time per iteration/ {
        n++
        for (i = 1; i <= NF; i++) {
            if ($i == "(ms):") ms = $(i + 1)
            if ($i == "loss:" && $(i - 1) == "lm") loss = $(i + 1)
        }
        if (n == 1) first = loss
        if (n > 2) { t += ms; k++ }   # skip warm-up (compilation, autotuning)
    }
    END {
        if (n == 0) { print "no iteration lines in the log"; exit 1 }
        printf "iterations: %d, lm loss first %s last %s\n", n, first, loss
        if (k > 0) printf "mean time/iter (after 2 warm-up): %.1f ms, %.0f tokens/s\n", t / k, gbs * seq / (t / k / 1000)
    }' "$LOG" || { if [ "$rc" = 0 ]; then rc=1; fi; }
if [ -n "$JSON" ]; then
    python3 benchmarks/megatron_log.py --log "$LOG" --out "$JSON" --attention "$ATTENTION" \
        --seq "$SEQ" --gbs "$GBS" --layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" \
        --kv-groups "$KV_GROUPS" --vocab "$VOCAB" || { if [ "$rc" = 0 ]; then rc=1; fi; }
fi
exit "$rc"
