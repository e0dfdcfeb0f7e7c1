# Every target sets itself up: a fresh clone needs only python3 (>= 3.10) and pip.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS ?= dev,triton,megatron,ray,hf,eval,tensorboard

.PHONY: setup setup-megatron wheel test test-slow lint demo demo-ops demo-1m demo-recall demo-python sample bench bench-sp bench-recall bench-lm bench-precision gpu-aot gpu-check gpu-quality gpu-wheels gpu-lease-dry clean

$(STAMP): pyproject.toml requirements-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	# The constraints file pins the CPU build of torch; pyproject leaves it open for GPU users.
	$(PY) -m pip install -q -c requirements-cpu.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

# What a user installs on a machine without this checkout (docs/eval.md, "Anywhere else"):
# dist/hla_sp-VERSION-py3-none-any.whl, pure Python, built offline with the venv's setuptools.
wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation --no-index -w dist .

# Python 3.12 with the CUDA build of torch (runs on CPU) and megatron-core 0.17-0.19, one
# directory each, for the tests that run Megatron's own pretrain() (tests/integration/test_megatron_pretrain.py).
# Without a Python 3.12 those tests skip, except under CI=true, where they fail.
VENV312        ?= .venv312
MCORE_DIR      ?= .mcore
MCORE_VERSIONS ?= 0.17.1 0.18.0 0.19.2
STAMP312       := $(VENV312)/.installed-stamp

$(STAMP312): requirements-megatron-py312.txt
	@py=$$(for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
	        /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	    "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
	    && { echo "$$p"; break; }; done); \
	if [ -z "$$py" ]; then \
	    echo "setup-megatron: no Python 3.12 found; Megatron's pretrain() tests will skip"; \
	    exit 0; fi; \
	set -ex; rm -rf $(VENV312) $(MCORE_DIR); "$$py" -m venv $(VENV312); \
	$(VENV312)/bin/python -m pip install -q -r requirements-megatron-py312.txt; \
	$(VENV312)/bin/python -m pip install -q --no-deps -e .; \
	touch $@

# Each megatron-core version in its own directory (--no-deps: torch, numpy, packaging are
# in the environment); a version added to MCORE_VERSIONS is installed on the next run.
setup-megatron: $(STAMP312)
	@if [ -f $(STAMP312) ]; then for v in $(MCORE_VERSIONS); do \
	    [ -f $(MCORE_DIR)/$$v/.installed ] && continue; set -x; rm -rf $(MCORE_DIR)/$$v; \
	    $(VENV312)/bin/python -m pip install -q --no-deps --target $(MCORE_DIR)/$$v \
	        megatron-core==$$v && touch $(MCORE_DIR)/$$v/.installed || exit 1; set +x; \
	done; fi

test: $(STAMP) setup-megatron
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" --timeout=900 --durations=25  # all durations: runs/test-durations.json

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --timeout=1800

lint: $(STAMP)
	$(PY) -m ruff check .

# The main job: a tiny HLA2 GPT under torchrun, context parallelism 2, on CPU (about
# 1.5 min on 2 cores). It resumes from its own checkpoint and says so (a finished run
# says "nothing to do"); rm -rf runs/demo starts it over. Ctrl-C saves and says how to resume.
demo: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 2 --context-parallel-size 2 \
	    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 1024 \
	    --micro-batch-size 4 --train-iters 60 --lr 3e-3 --lr-warmup-iters 5 \
	    --log-interval 5 --log-jsonl runs/demo/metrics.jsonl --save runs/demo/ckpt \
	    --load runs/demo/ckpt --exit-signal-handler

# A first sample that reads like Python: a small HLA2 GPT trained on the standard
# library's sources (1,000 steps of 4k bytes, DP 2: 8 min on 2 idle cores), then 300
# bytes sampled from it. It
# resumes like make demo (rm -rf runs/python starts it over); the sample's header names
# the iteration and the validation loss.
demo-python: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 2 --num-layers 2 --hidden-size 128 \
	    --num-attention-heads 4 --seq-length 256 --micro-batch-size 8 --train-iters 1000 \
	    --lr 2e-3 --lr-warmup-iters 50 --position-embedding-type none --eval-interval 200 \
	    --eval-iters 4 --log-interval 50 --log-jsonl runs/python/metrics.jsonl \
	    --save runs/python/ckpt --load runs/python/ckpt --save-interval 200 --exit-signal-handler
	$(PY) -m hla_sp.launch.cli generate --load runs/python/ckpt --prompt "def " \
	    --max-new-tokens 300 --temperature 0.7 --top-k 40

# The operators alone: chunked path against the serial recurrence, and a speed table.
demo-ops: $(STAMP)
	$(PY) benchmarks/ops_demo.py

# A million tokens of context: CP=4 on CPU with full activation recompute (about 4 min
# on 2 cores, about 2 GiB per rank).
demo-1m: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 4 --context-parallel-size 4 \
	    --seq-length 1048576 --num-layers 2 --hidden-size 32 --num-attention-heads 2 \
	    --position-embedding-type none --make-vocab-size-divisible-by 1 \
	    --recompute-granularity full --lr 3e-3 --train-iters 3 \
	    --log-jsonl runs/demo-1m/metrics.jsonl

bench: $(STAMP)
	$(PY) benchmarks/bench_ops.py --threads 1

# Sample 200 bytes from the demo's checkpoint (run make demo first).
sample: $(STAMP)
	$(PY) -m hla_sp.launch.cli generate --load runs/demo/ckpt --prompt "def " \
	    --max-new-tokens 200 --temperature 0.8 --top-k 40

# Recall across context-parallel ranks: the pairs on rank 0, the queries on rank 3
# (600 steps, about 20 min on 2 cores).
demo-recall: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 4 --context-parallel-size 4 \
	    --data synthetic-recall --recall-pairs 4 --seq-length 64 --num-layers 2 \
	    --hidden-size 64 --num-attention-heads 2 --micro-batch-size 64 --train-iters 600 \
	    --lr 3e-3 --lr-warmup-iters 50 --eval-interval 50 --eval-iters 2 --log-interval 50 \
	    --log-jsonl runs/demo-recall/metrics.jsonl

# Does the layer learn from context? MQAR under Zoology's protocol (docs/quality.md), in
# parts that each resume where a stopped run left off: the learning-rate sweep at
# (256, 16), then every size at each mixer's best rate, then (512, 64) at d_model 128.
# CPU hours: about 20 min per run at (256, 16) on one core; the whole grid is a few
# hundred runs (a multi-session job on 2 cores), so run the part you need.
RECALL_MIXERS ?= softmax,linear,gated-linear,hla2,ahla,hla3
RECALL_OUT    ?= benchmarks/results
bench-recall: $(STAMP)
	$(PY) benchmarks/bench_recall.py --sizes 256x16 --mixers $(RECALL_MIXERS) \
	    --lrs 1e-3,3e-3,1e-2 --seeds 0,1,2 --name recall_grid --out $(RECALL_OUT)
	$(PY) benchmarks/bench_recall.py --sizes 64x4,128x8,256x16 --mixers $(RECALL_MIXERS) \
	    --lrs best --seeds 0,1,2 --name recall_grid --out $(RECALL_OUT)
	$(PY) benchmarks/bench_recall.py --sizes 512x64 --d-model 128 --mixers $(RECALL_MIXERS) \
	    --lrs best --seeds 0,1,2 --name recall_grid --out $(RECALL_OUT)

# Byte-level language modelling, 3 seeds per mixer (about 15 min per run on one core).
bench-lm: $(STAMP)
	$(PY) benchmarks/bench_lm.py --seeds 0,1,2 --out benchmarks/results

bench-sp: $(STAMP)
	for b in traffic overhead memory million; do $(PY) benchmarks/bench_sp_$$b.py || exit 1; done

# No GPU needed: compile every launched kernel configuration for sm_90a and sm_80 and
# gate registers, spills and shared memory (benchmarks/results/aot.json, docs/benchmarks.md).
gpu-aot: $(STAMP)
	$(PY) benchmarks/aot.py

# The 16-bit fast path's error against fp64, beside the exact path and the naive form in bf16.
bench-precision: $(STAMP)
	$(PY) benchmarks/bench_precision.py --out benchmarks/results
	$(PY) benchmarks/bench_precision.py --out benchmarks/results --backend triton --T 128 256

# On a CUDA machine: the capacity study, MQAR at (512, 64), d_model 128, hla2, linear,
# gated-linear and softmax over 8 seeds each, side by side on the one GPU (within 8 min;
# `python benchmarks/gpu_quality.py --plan` shows the sizing). Uses the environment's
# python (a CUDA build of torch), as gpu-check does.
gpu-quality:
	$${PYTHON:-python} benchmarks/gpu_quality.py

# Wheels for the GPU machine, which has no package registry: fla-core (the measured peer;
# pure Python, and it needs einops and packaging besides torch and triton) and
# megatron-core for Python 3.12, into the gitignored .whl/ (about 3.6 MB; carry `.whl`
# with the device run). benchmarks/gpu_lease.sh installs them offline with --no-deps, so
# nothing here pulls torch. Any pip does (downloads only): no venv is set up for it.
GPU_WHEELS      ?= fla-core==0.6.0 einops==0.8.2 packaging==26.4
GPU_MCORE       ?= 0.19.2
GPU_PY_VERSION  ?= 3.12
PIP_DOWNLOAD    := $${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: -d .whl
gpu-wheels:
	mkdir -p .whl
	$(PIP_DOWNLOAD) $(GPU_WHEELS)
	$(PIP_DOWNLOAD) --python-version $(GPU_PY_VERSION) \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    megatron-core==$(GPU_MCORE)
	@ls -l .whl; du -sh .whl

# The lease script's plumbing on CPU (tiny shapes, no GPU; tests/integration/test_gpu_lease.py runs it).
gpu-lease-dry: $(STAMP)
	OUT=runs/gpu_lease_dry PYTHON=$(PY) bash benchmarks/gpu_lease.sh --dry-run

# On a CUDA machine: kernels against the reference, timings against SDPA and fla.
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) $(VENV312) $(MCORE_DIR) .pytest_cache .ruff_cache
