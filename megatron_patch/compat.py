"""What differs between megatron-core releases, decided by what the installed one offers.

* :func:`version_check`: the megatron-core releases the test suite runs
  (:data:`TESTED_VERSIONS`): an older one is refused, a newer one is said to be
  untested.
* :func:`cp_split`: ``get_batch_on_this_cp_rank``. From 0.18 it takes a required
  ``is_hybrid_cp`` and reads ``cp_group=None`` as the WORLD group (before 0.18, None
  meant parallel_state's CP group). We always pass ``is_hybrid_cp=False`` where the
  signature has it and the context-parallel group explicitly, so a run with data or
  tensor parallelism beside CP splits over the right ranks.
* :func:`pretrain_api`: three ``megatron.training.pretrain`` signatures:

  ========  ==============================================================  =========
  route     signature                                                       versions
  ========  ==============================================================  =========
  legacy    ``pretrain(datasets, model_provider, model_type, forward, ...)``  <= 0.17
  provider  ``pretrain(cfg_container, datasets, model_provider, ...)``         0.18
  config    ``pretrain(cfg_container, datasets, model_type, forward,``       0.19+
            ``model_provider=None, ...)`` and ``gpt_config_from_args``
  ========  ==============================================================  =========
* :func:`tokenizer`: Megatron's tokenizer, from ``get_tokenizer`` or whichever module
  of this release builds it.
* :func:`prebuilt_dataset_helpers`: a pip-installed megatron-core ships its dataset
  helpers compiled but without the Makefile that Megatron's start-up ``make`` needs.
* :func:`rotary_on_host`: a forward of a RoPE model on the CPU (every release moves the
  rotary frequencies to ``torch.cuda.current_device()`` on the first forward).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

PRETRAIN_ROUTES = ("legacy", "provider", "config")
# The megatron-core releases the test suite runs hla-sp train and pretrain() on: 0.16.1 in
# the Python 3.11 environment, the rest (which need Python >= 3.12) in .venv312 (the
# Makefile's MCORE_VERSIONS, checked against this by tests/integration/test_megatron_versions.py).
# pyproject's ``megatron`` extra stops at the newest.
TESTED_VERSIONS = ("0.16.1", "0.17.1", "0.18.0", "0.19.2")


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.19.2rc1" -> (0, 19, 2)."""
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def installed_version() -> str | None:
    """The installed megatron-core's version (None if it is not installed)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


_warned: set[str] = set()


def check_version(prog: str) -> None:
    """:func:`version_check` for a command: raise for a release older than the tested
    ones; print the warning for a newer one once, on rank 0 only (every worker checks).

    Raises:
        ValueError: the installed megatron-core is older than ``TESTED_VERSIONS[0]``.
    """
    warning = version_check()
    if warning and warning not in _warned and os.environ.get("RANK", "0") == "0":
        _warned.add(warning)
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)


def version_check(version: str | None = None) -> str | None:
    """Refuse a megatron-core older than the oldest tested; for one newer than the newest
    tested, return a one-line warning (None when it is a tested range's release).

    Raises:
        ValueError: ``version`` is older than ``TESTED_VERSIONS[0]``.
    """
    version = installed_version() if version is None else version
    if version is None:
        return None
    oldest, newest = TESTED_VERSIONS[0], TESTED_VERSIONS[-1]
    if _release(version) < _release(oldest):
        raise ValueError(f"megatron-core: expected >= {oldest} (the oldest release hla-sp is "
                         f"tested on), got {version}: pip install \"megatron-core>={oldest},"
                         f"<={newest}\"")
    if _release(version) > _release(newest):
        return (f"megatron-core {version} is newer than the newest release hla-sp is tested "
                f"on ({newest}); it may work. If it fails: pip install "
                f"\"megatron-core=={newest}\"")
    return None


def pretrain_api(pretrain: Callable, argument_utils: Any = None) -> str:
    """Which ``pretrain`` this is: "legacy", "provider" or "config" (see module doc).

    Args:
        pretrain: ``megatron.training.pretrain``.
        argument_utils: ``megatron.training.argument_utils`` (None: imported if present).

    Raises:
        RuntimeError: a signature none of the three routes fits.
    """
    params = list(inspect.signature(pretrain).parameters.values())
    names = [p.name for p in params]
    if not names or names[0] != "cfg_container":
        if "model_provider" in names[:3]:
            return "legacy"
        raise RuntimeError(f"megatron.training.pretrain{inspect.signature(pretrain)}: an API "
                           "this entry point does not know; please report it")
    provider = next((p for p in params if p.name == "model_provider"), None)
    if provider is not None and provider.default is inspect.Parameter.empty:
        return "provider"  # 0.18: the model still comes from model_provider
    if argument_utils is None:
        try:
            argument_utils = importlib.import_module("megatron.training.argument_utils")
        except ImportError:
            argument_utils = None
    if provider is not None and not hasattr(argument_utils, "gpt_config_from_args"):
        return "provider"  # optional provider but no GPT model config to build from flags
    if provider is None and not hasattr(argument_utils, "gpt_config_from_args"):
        raise RuntimeError(f"megatron.training.pretrain{inspect.signature(pretrain)}: takes a "
                           "config container but neither a model_provider nor "
                           "argument_utils.gpt_config_from_args exists; please report it")
    return "config"


def cp_split(batch: dict[str, Any], cp_group: Any, fn: Callable | None = None) -> dict[str, Any]:
    """``get_batch_on_this_cp_rank(batch)`` over ``cp_group``, on every version.

    Args:
        batch: the micro-batch (``tokens``, ``labels``, ... as [b, s, ...] tensors).
        cp_group: the context-parallel process group (never None: from 0.18 None means
            WORLD, which is wrong as soon as data or tensor parallelism is > 1).
        fn: the function to call (default: megatron's, wherever this version has it).
    """
    if cp_group is None:
        raise ValueError("cp_group: expected the context-parallel process group, got None "
                         "(megatron-core >= 0.18 would split over WORLD)")
    if fn is None:
        try:
            from megatron.core.utils import get_batch_on_this_cp_rank as fn
        except ImportError:
            from megatron.training.utils import get_batch_on_this_cp_rank as fn
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    if "is_hybrid_cp" in params:
        kwargs["is_hybrid_cp"] = False  # Megatron's hybrid CP is for packed SFT batches
    if "cp_group" in params:
        kwargs["cp_group"] = cp_group
    return fn(batch, **kwargs)


BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def tp_broadcast_batch(batch: dict[str, Any] | None, *, micro_batch_size: int, seq_length: int,
                       with_attention_mask: bool, group: Any, src: int,
                       device: Any) -> dict[str, Any]:
    """The micro-batch of tensor-parallel rank 0, on every rank of its TP group.

    Megatron builds the data loader on TP rank 0 only. Its own broadcast helper changed
    signature in every release (``get_batch_on_this_tp_rank(data_iterator)`` up to 0.17,
    a dozen keyword arguments in megatron.core.utils from 0.19), so the five tensors a
    GPT step needs are broadcast here, with the shapes and dtypes Megatron's GPT
    datasets give them.

    Args:
        batch: the batch on the source rank (``BATCH_KEYS``), None elsewhere.
        group, src: the TP group and its rank 0 (a global rank).
    """
    import torch

    shapes = {
        "tokens": ((micro_batch_size, seq_length), torch.int64),
        "labels": ((micro_batch_size, seq_length), torch.int64),
        "loss_mask": ((micro_batch_size, seq_length), torch.float32),
        "position_ids": ((micro_batch_size, seq_length), torch.int64),
    }
    if with_attention_mask:
        shapes["attention_mask"] = ((micro_batch_size, 1, seq_length, seq_length), torch.bool)
    is_src = torch.distributed.get_rank() == src
    out: dict[str, Any] = dict.fromkeys(BATCH_KEYS)
    for key, (shape, dtype) in shapes.items():
        if is_src:
            t = batch[key].to(device=device, dtype=dtype).contiguous()  # type: ignore[index]
            if tuple(t.shape) != shape:
                raise ValueError(f"batch[{key!r}]: expected shape {shape}, got {tuple(t.shape)}")
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(t, src, group=group)
        out[key] = t
    return out


def tokenizer(args: Any) -> Any:
    """Megatron's tokenizer, wherever this version keeps it."""
    from megatron import training

    get = getattr(training, "get_tokenizer", None)
    if get is not None:
        try:
            tok = get()
        except Exception:  # newer versions assert instead of returning None
            tok = None
        if tok is not None:
            return tok
    for path in ("megatron.core.tokenizers.utils.build_tokenizer",
                 "megatron.core.tokenizers.text.utils.build_tokenizer",
                 "megatron.training.tokenizer.tokenizer"):
        try:
            mod = importlib.import_module(path)
        except ImportError:
            continue
        if hasattr(mod, "build_tokenizer"):
            return mod.build_tokenizer(args)
    raise RuntimeError("no tokenizer builder found in this megatron version")


@contextlib.contextmanager
def rotary_on_host() -> Iterator[None]:
    """Inside the block, megatron-core's rotary embedding stays on the CPU.

    ``RotaryEmbedding.get_emb`` moves its inverse frequencies to
    ``torch.cuda.current_device()`` at the first forward, whatever the model's device,
    so a RoPE model cannot run forward on a machine without CUDA. Export checks its
    output against the checkpoint's model, and a GPU run's checkpoint is often exported
    on a CPU host: there "the current device" is the CPU. On a CUDA machine the block
    changes nothing.
    """
    import torch

    if torch.cuda.is_available():
        yield
        return
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = real  # type: ignore[assignment]


def prebuilt_dataset_helpers() -> bool:
    """Skip Megatron's start-up compile of the dataset helpers when they are already built.

    ``megatron.training`` runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits
    if it fails. The megatron-core wheel ships ``helpers_cpp`` compiled and no Makefile,
    so a pip-installed Megatron stops there (seen on an H200 with 0.19.2). When the
    compiled module imports, the compile is a no-op; otherwise (a source checkout)
    Megatron compiles as usual. Returns whether the compile was skipped.
    """
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    utils = importlib.import_module("megatron.core.datasets.utils")
    utils.compile_helpers = lambda: None
    return True
