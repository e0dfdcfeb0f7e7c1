"""Lazily jitted Triton kernels, with a launch counter.

``triton.jit`` decides at decoration time whether a kernel is compiled for a GPU or run
by the CPU interpreter (``TRITON_INTERPRET=1``). Decorating at import would freeze that
choice when ``hla_sp.kernels`` is first imported, so a test that sets the variable later
(or a process that imports the package before choosing) would get the wrong kind. Here
the kernel object is built on first launch, once per mode, and nothing at import time
touches a GPU driver.

One more wrinkle: Triton's standard library (``tl.sum``, ``tl.cumsum``, ``tl.cdiv``)
is jitted when ``triton`` is imported, so after an import without the interpreter
those helpers are GPU functions that the interpreter refuses to call. Interpreted
launches then swap interpreter builds of them into ``triton.language`` for the
duration of the launch (the interpreter patches that module the same way for its
builtins) and restore them afterwards.

Helpers that kernels call (:func:`jit_helper`, e.g. the in-chunk decay of
:mod:`hla_sp.kernels._decay`) are plain ``JITFunction`` objects whatever the mode, so
that a GPU build (or an ahead-of-time compile) can inline them; an interpreted launch
swaps interpreter builds of them into the kernel's module the same way.

Every launch increments :data:`LAUNCHES` under the kernel's name, so tests can prove
that the Triton path ran rather than a silent fallback.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import triton

LAUNCHES: Counter[str] = Counter()
# While a list (inside :func:`capture`): launches are described here and not run.
_CAPTURE: list[dict[str, Any]] | None = None
_CAPTURE_EVERY = False  # inside capture(every=True): every tuning candidate is described
# Inside :func:`for_archs`: the compute capabilities (90 for sm_90) the described launches
# are for; None: every one.
_CAPTURE_ARCHS: tuple[int, ...] | None = None
KERNELS: dict[str, LazyKernel] = {}  # every kernel defined, by name (filled by lazy_jit)


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_mismatch() -> str | None:
    """Why the current interpreter mode cannot run kernels, or None when it can."""
    from triton.runtime.jit import JITFunction

    stdlib_compiled = isinstance(triton.language.standard.cdiv, JITFunction)
    if not interpreting() and not stdlib_compiled:
        return "triton was imported with TRITON_INTERPRET=1, which is no longer set"
    return None


_STDLIB_INTERPRETED: dict[int, Any] = {}
# Modules defining jit helpers: a helper that calls another helper looks it up there.
_HELPER_MODULES: set[str] = set()


def jit_helper(fn: Callable[..., Any]) -> Any:
    """Decorator for a ``@triton.jit`` helper that kernels call: always a JITFunction.

    ``triton.jit`` would return an interpreter object when ``TRITON_INTERPRET=1`` is set
    at import, which a GPU compile cannot inline; interpreted launches swap in an
    interpreter build instead (:func:`_interpretable_stdlib`).
    """
    from triton.runtime.jit import JITFunction

    _HELPER_MODULES.add(fn.__module__)
    return JITFunction(fn)


@contextmanager
def _interpretable_stdlib(*extra: Any) -> Iterator[None]:
    """Interpreter builds of Triton's jitted standard library and of the jitted helpers
    bound in the modules ``extra`` (the launching kernel's module) and in the helpers'
    own modules (helpers calling helpers), for one launch."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped = []
    helpers = [sys.modules[m] for m in sorted(_HELPER_MODULES)]
    for mod in (triton.language, standard, triton.language.math, *extra, *helpers):
        for name, val in list(vars(mod).items()):
            if isinstance(val, JITFunction):
                if id(val) not in _STDLIB_INTERPRETED:
                    _STDLIB_INTERPRETED[id(val)] = InterpretedFunction(val.fn)
                swapped.append((mod, name, val))
                setattr(mod, name, _STDLIB_INTERPRETED[id(val)])
    try:
        yield
    finally:
        for mod, name, val in swapped:
            setattr(mod, name, val)


class LazyKernel:
    """A Triton kernel that is jitted on first launch (``kernel[grid](...)``)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._built: dict[bool, Any] = {}

    def _get(self) -> Any:
        mode = interpreting()
        reason = interpreter_mismatch()
        if reason is not None:
            raise RuntimeError(f"cannot launch {self.__name__}: {reason}")
        if mode not in self._built:
            self._built[mode] = triton.jit(self.fn)
        return self._built[mode]

    def __getitem__(self, grid: tuple[int, ...] | Callable[..., tuple[int, ...]]) -> Callable:
        launch = self._get()[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            LAUNCHES[self.__name__] += 1
            if _CAPTURE is not None:
                job = self.describe(args, kwargs)
                if _CAPTURE_ARCHS:
                    job["archs"] = list(_CAPTURE_ARCHS)
                _CAPTURE.append(job)
                return None
            if not interpreting():
                return launch(*args, **kwargs)
            with _interpretable_stdlib(sys.modules[self.fn.__module__]):
                return launch(*args, **kwargs)

        return run


    def describe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """One launch as a compile job: Triton signature, constexpr values, options.

        Tensors become pointer types (``*fp32``), ints ``i32``/``i64``, floats ``fp32``;
        None and ``tl.constexpr`` parameters become constexprs. ``num_warps`` and
        ``num_stages`` are the launch's, or Triton's CUDA defaults (4 and 3).
        """
        import torch

        names = list(inspect.signature(self.fn).parameters)
        params = inspect.signature(self.fn).parameters
        opts = {"num_warps": 4, "num_stages": 3}
        values = dict(zip(names, args, strict=False))
        for key, val in kwargs.items():
            if key in opts:
                opts[key] = int(val)
            else:
                values[key] = val
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for name in names:
            val = values[name]
            if "constexpr" in str(params[name].annotation) or val is None:
                signature[name] = "constexpr"
                constexprs[name] = val
            elif isinstance(val, torch.Tensor):
                signature[name] = "*" + _TRITON_DTYPES[val.dtype]
            elif isinstance(val, bool):
                signature[name] = "i1"
            elif isinstance(val, int):
                signature[name] = "i32" if -(2**31) <= val < 2**31 else "i64"
            elif isinstance(val, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{self.__name__}: cannot describe argument {name}={val!r}")
        return {"kernel": self.__name__, "signature": signature, "constexprs": constexprs,
                **opts}


def _dtype_names() -> dict[Any, str]:
    import torch

    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.int32: "i32", torch.int64: "i64", torch.bool: "i1", torch.float64: "fp64"}


class _DtypeNames(dict):
    """torch dtype -> Triton type name, built on first use (no torch import at import)."""

    def __missing__(self, key: Any) -> str:
        self.update(_dtype_names())
        return dict.__getitem__(self, key)


_TRITON_DTYPES: dict[Any, str] = _DtypeNames()


@contextmanager
def capture(every: bool = False) -> Iterator[list[dict[str, Any]]]:
    """Describe every kernel launch (:meth:`LazyKernel.describe`) instead of running it;
    ``every``: also every candidate configuration of a tuned launch
    (:func:`hla_sp.kernels._tiles.tuned`), not only its default.

    Outputs of captured launches are left uninitialised, so only the launch
    configurations, not the values, mean anything inside this context.
    """
    global _CAPTURE, _CAPTURE_EVERY
    before, _CAPTURE = _CAPTURE, []
    every_before, _CAPTURE_EVERY = _CAPTURE_EVERY, every
    try:
        yield _CAPTURE
    finally:
        _CAPTURE, _CAPTURE_EVERY = before, every_before


def capturing_every() -> bool | None:
    """None outside :func:`capture`; inside, its ``every``."""
    return None if _CAPTURE is None else _CAPTURE_EVERY


@contextmanager
def for_archs(archs: tuple[int, ...]) -> Iterator[None]:
    """Launches described inside are for these compute capabilities only (a tuning
    candidate that only they launch): their jobs carry ``"archs"``, and the
    ahead-of-time gate compiles them for those alone. () means every arch."""
    global _CAPTURE_ARCHS
    before, _CAPTURE_ARCHS = _CAPTURE_ARCHS, (tuple(archs) or None)
    try:
        yield
    finally:
        _CAPTURE_ARCHS = before


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    """Decorator: a :class:`LazyKernel` of ``fn``, registered in :data:`KERNELS`."""
    kernel = LazyKernel(fn)
    KERNELS[kernel.__name__] = kernel
    return kernel
