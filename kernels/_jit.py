"""Lazily jitted Triton kernels, with a launch counter.

``triton.jit`` decides at decoration time whether a kernel is compiled for a GPU or run
by the CPU interpreter (``TRITON_INTERPRET=1``). Decorating at import would freeze that
choice when ``hla_sp.kernels`` is first imported, so a test that sets the variable later
(or a process that imports the package before choosing) would get the wrong kind. Here
the kernel object is built on first launch, once per mode, and nothing at import time
touches a GPU driver.

One limit of Triton remains: its standard library (``tl.sum``, ``tl.cumsum``,
``tl.cdiv``) is jitted when ``triton`` is imported, so the interpreter works only if
``TRITON_INTERPRET=1`` was set before that import. :func:`interpreter_mismatch`
detects the other case, and launching then fails with that explanation.

Every launch increments :data:`LAUNCHES` under the kernel's name, so tests can prove
that the Triton path ran rather than a silent fallback.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import triton

LAUNCHES: Counter[str] = Counter()


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_mismatch() -> str | None:
    """Why the current interpreter mode cannot run kernels, or None when it can."""
    from triton.runtime.jit import JITFunction

    stdlib_compiled = isinstance(triton.language.standard.cdiv, JITFunction)
    if interpreting() and stdlib_compiled:
        return (
            "TRITON_INTERPRET=1 was set after triton was imported; Triton's standard "
            "library is then built for the GPU. Set it before the first `import triton`"
        )
    if not interpreting() and not stdlib_compiled:
        return "triton was imported with TRITON_INTERPRET=1, which is no longer set"
    return None


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
            return launch(*args, **kwargs)

        return run


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    """Decorator: a :class:`LazyKernel` of ``fn``."""
    return LazyKernel(fn)
