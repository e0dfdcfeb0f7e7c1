#!/usr/bin/env bash
# The GPU lease's environment, offline: every wheel of .whl/ (make gpu-wheels: fla-core,
# einops, packaging, megatron-core) into SITE and hla_sp editable, with --no-deps (torch
# and triton are the machine's), then the versions that will run (SITE on PYTHONPATH).
#   bash benchmarks/gpu_env.sh SITE [PYTHON]
set -uo pipefail
cd "$(dirname "$0")/.."
site=${1:?usage: gpu_env.sh SITE [PYTHON]}
py=${2:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
rm -rf "$site" && mkdir -p "$site" || exit 1
status=0
if compgen -G ".whl/*.whl" >/dev/null; then
    ls -l .whl
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl || exit 1
else
    echo "no .whl/: run make gpu-wheels and carry .whl (fla's and Megatron's figures will be missing)"
    status=1
fi
# hla_sp editable into the machine's python (as the first lease did): its package-dir
# mapping (hla_sp.kernels, hla_sp.launch, hla_sp.megatron_patch) then resolves also where
# the working directory's hla_sp/ comes first on sys.path (python -m, torchrun workers).
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'PY' || status=1
import importlib
import sys

import torch
import triton

print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
missing = []
for name in ("hla_sp", "hla_sp.kernels", "einops", "fla", "megatron.core"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", ""), m.__file__)
    except Exception as e:  # reported; the stages that need it fail on their own
        print(name, "does not import:", type(e).__name__, e)
        missing.append(name)
sys.exit(1 if missing else 0)
PY
exit "$status"
