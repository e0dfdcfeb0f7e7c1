"""The exported model on a machine without this checkout: the wheel in a fresh venv.

docs/eval.md ("Anywhere else") tells a user to build the wheel (``make wheel``) and to
``pip install`` it with the ``hf`` extra next to torch. This test does exactly that in a
new venv whose site-packages holds only the distributions that install brings (torch,
transformers and their requirements, each a symlink into this environment's
site-packages, so nothing is downloaded) and pip, never this checkout: the venv runs
from a temporary directory with no PYTHONPATH, and checks that ``hla_sp`` comes from its
own site-packages. There the export of a real ``hla-sp train`` run loads through
``AutoModelForCausalLM`` (trust_remote_code=True); its logits equal the checkpoint's and
its greedy continuation is ``hla-sp generate --temperature 0``'s, byte for byte.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

pytest.importorskip("megatron.core")

from hla_sp.launch.distributed.local import worker_env as _env
from hla_sp.launch.export import generate as gen

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")
# what the wheel is built from (pyproject.toml's packages and package-dir)
SOURCES = ["pyproject.toml", "README.md", "hla_sp", "kernels", "launch", "megatron_patch"]
PROMPT, NEW = "def ", 40
TRAIN = ["--nproc-per-node", "1", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "64", "--train-iters", "3",
         "--micro-batch-size", "2", "--lr", "3e-3", "--seed", "7",
         "--position-embedding-type", "none"]  # fmt: skip
# fp32, the same operations on the same weights (tests/integration/test_hf_export.py's bound)
REL = 1e-5

_LOAD = """
import json, sys, hla_sp, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
with torch.no_grad():
    logits = model(ids).logits[0]
prompt = tok(sys.argv[3], return_tensors="pt").input_ids
out = model.generate(prompt, max_new_tokens=int(sys.argv[4]), do_sample=False)
print(json.dumps({"hla_sp": hla_sp.__file__, "logits": logits.tolist(),
                  "text": tok.decode(out[0])}))
"""


def _closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """``name`` and every distribution its requirements (with ``extras``) pull in, as
    installed here."""
    seen: set[str] = set()
    todo = [(name, extras)]
    while todo:
        dist_name, ex = todo.pop()
        dist = md.distribution(dist_name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen and not ex:
            continue
        seen.add(key)
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((req.name, tuple(req.extras)))
    return seen


def _link_distributions(names: set[str], site: Path) -> None:
    """Symlink each distribution's top-level files (its RECORD) into ``site``."""
    for name in names:
        dist = md.distribution(name)
        base = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or (site / top).exists() or not (base / top).exists():
                continue
            (site / top).symlink_to(base / top)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A checkpoint, its export, and a fresh venv holding the wheel with the hf extra."""
    d = tmp_path_factory.mktemp("wheel")
    ckpt, hf = d / "ckpt", d / "hf"
    p = subprocess.run([HLA_SP, "train", *TRAIN, "--save", str(ckpt)], capture_output=True,
                       text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = subprocess.run([HLA_SP, "export", "--load", str(ckpt), "--output", str(hf)],
                       capture_output=True, text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    # make wheel's command, on a copy of the sources (the build writes build/ beside them);
    # the SPDX license needs setuptools >= 77, which make setup installs
    import setuptools
    from packaging.version import Version

    assert Version(setuptools.__version__) >= Version("77"), (
        f"setuptools {setuptools.__version__} in this venv: make setup installs >= 77")
    src = d / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *SOURCES],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in files.split():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((ROOT / rel).read_bytes())
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", "-w", str(d / "dist"), "."],
                       cwd=src, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (wheel,) = (d / "dist").glob("hla_sp-*-py3-none-any.whl")
    # the venv: what `pip install torch` and `pip install "WHEEL[hf]"` bring, and pip
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    hf_deps = _closure("hla-sp", ("hf",)) - {"hla-sp"}
    _link_distributions(hf_deps | {"pip"}, site)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(d), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--no-index", f"{wheel}[hf]"], cwd=d, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return {"ckpt": ckpt, "hf": hf, "venv": venv, "site": site, "tmp": d, "env": env}


def _ids() -> torch.Tensor:
    return torch.randint(0, 257, (1, 48), generator=torch.Generator().manual_seed(3))


def test_fresh_venv_loads_the_export_like_generate(installed: dict) -> None:
    ids = _ids()
    p = subprocess.run([str(installed["venv"] / "bin" / "python"), "-c", _LOAD,
                        str(installed["hf"]), json.dumps(ids.tolist()), PROMPT, str(NEW)],
                       cwd=installed["tmp"], env=installed["env"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    # the wheel's package, never this checkout
    assert Path(got["hla_sp"]).is_relative_to(installed["site"]), got["hla_sp"]
    warnings.simplefilter("ignore")
    with gen.single_process():
        model, _ = gen.load_model(str(installed["ckpt"]))
        with torch.no_grad():
            want = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :257].float()
    err = float((torch.tensor(got["logits"]) - want).abs().max())
    assert err <= REL * float(want.abs().max()), err
    p = subprocess.run([HLA_SP, "generate", "--load", str(installed["ckpt"]), "--prompt",
                        PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"],
                       capture_output=True, text=True, env=_env(None), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    # generate prints the prompt, the continuation (up to an end of document), a new line
    assert got["text"].removesuffix("<|endoftext|>") == p.stdout.removesuffix("\n"), (
        got["text"], p.stdout)


def test_without_hla_sp_the_export_says_how_to_install(installed: dict) -> None:
    """The same venv without the wheel: one line naming the wheel and make wheel."""
    env = installed["env"]
    subprocess.run([str(installed["venv"] / "bin" / "python"), "-m", "pip", "uninstall",
                    "-q", "-y", "hla-sp"], env=env, check=True, capture_output=True)
    p = subprocess.run([str(installed["venv"] / "bin" / "python"), "-c",
                        "import sys\nfrom transformers import AutoModelForCausalLM\n"
                        "AutoModelForCausalLM.from_pretrained(sys.argv[1], "
                        "trust_remote_code=True)", str(installed["hf"])],
                       cwd=installed["tmp"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 1
    assert re.search(r'^ImportError: this model\'s code is hla-sp\'s: pip install '
                     r'"hla_sp-0\.1\.0-py3-none-any\.whl\[hf\]" \(make wheel in an hla-sp '
                     r'checkout builds it; docs/eval\.md\)$', p.stderr, flags=re.M), p.stderr
