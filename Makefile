# Every target sets itself up: a fresh clone needs only python3 (>= 3.10) and pip.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS ?= dev,triton,megatron,ray

.PHONY: setup test test-slow lint demo demo-ops demo-1m bench bench-sp gpu-check clean

$(STAMP): pyproject.toml requirements-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The constraints file pins the CPU build of torch; pyproject leaves it open for GPU users.
	$(PY) -m pip install -q -c requirements-cpu.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" --timeout=900

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --timeout=1800

lint: $(STAMP)
	$(PY) -m ruff check .

# The main job: a tiny HLA2 GPT under torchrun, context parallelism 2, on CPU.
demo: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 2 --context-parallel-size 2 \
	    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 1024 \
	    --micro-batch-size 4 --train-iters 60 --lr 3e-3 --lr-warmup-iters 5 \
	    --log-interval 5 --log-jsonl runs/demo/metrics.jsonl --save runs/demo/ckpt

# The operators alone: chunked path against the serial recurrence, and a speed table.
demo-ops: $(STAMP)
	$(PY) benchmarks/ops_demo.py

# A million tokens of context: CP=4 on CPU with full activation recompute (minutes).
demo-1m: $(STAMP)
	$(PY) -m hla_sp.launch.cli train --nproc-per-node 4 --context-parallel-size 4 \
	    --seq-length 1048576 --num-layers 2 --hidden-size 32 --num-attention-heads 2 \
	    --position-embedding-type none --make-vocab-size-divisible-by 1 \
	    --recompute-granularity full --lr 3e-3 --train-iters 3 \
	    --log-jsonl runs/demo-1m/metrics.jsonl

bench: $(STAMP)
	$(PY) benchmarks/bench_ops.py --threads 1

bench-sp: $(STAMP)
	for b in traffic overhead memory million; do $(PY) benchmarks/bench_sp_$$b.py || exit 1; done

# On a CUDA machine: kernels against the reference, timings against SDPA and fla.
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
