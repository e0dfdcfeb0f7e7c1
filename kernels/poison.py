"""Launchers of the poison kernels (:mod:`hla_sp.kernels.poison_kernels`) and the
flags they read (:mod:`hla_sp.kernels._flags`).

Used by :mod:`hla_sp.kernels.chunk` when a call asks for isolation: its state passes
raise the flags while they read the inputs, and one gated launch per direction puts
the poison back. On finite inputs that launch reads B H words and returns.
"""

from __future__ import annotations

import torch

from .poison_kernels import poison_bwd_kernel, poison_fwd_kernel

BLOCK = 64  # tokens per step of the scans over T
BD = 64  # row width per store


def new_flags(B: int, T: int, H: int, device: torch.device) -> torch.Tensor:
    """Zeroed flags [B, T + 2, H] int32 of a call with H kv heads."""
    return torch.zeros(B, T + 2, H, dtype=torch.int32, device=device)


def poison_forward(
    fl: torch.Tensor, g: torch.Tensor | None, resets: torch.Tensor | None, o: torch.Tensor,
    h_last: torch.Tensor | None,
) -> None:
    """In place: NaN into o [B, T, H G, V] and h_last [B, H, K, V] where the forward's
    flags ``fl`` [B, T + 2, H] reach (prepared g [B, T, H] fp32, resets [B, T] int32)."""
    B, T2, H = fl.shape
    HQ, V = o.shape[2], o.shape[3]
    K = 1 if h_last is None else h_last.shape[2]
    poison_fwd_kernel[(B * H,)](
        fl, g, resets, o, h_last, T2 - 2, H, K, V, G=HQ // H, BLOCK=BLOCK, BD=BD,
        HAS_G=g is not None, HAS_R=resets is not None, STORE_LAST=h_last is not None,
        num_warps=4,
    )


def poison_backward(
    ff: torch.Tensor, fb: torch.Tensor, g: torch.Tensor | None, resets: torch.Tensor | None,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dg: torch.Tensor | None,
    dh0: torch.Tensor | None,
) -> None:
    """In place: NaN into every gradient of the segments that the forward's flags ``ff``
    and the backward's ``fb`` (both [B, T + 2, H]) poison: dq [B, T, H G, K], dk
    [B, T, H, K], dv [B, T, H, V], dg [B, T, H] fp32, dh0 [B, H, K, V] fp32."""
    B, T2, H = ff.shape
    HQ, K, V = dq.shape[2], dq.shape[3], dv.shape[3]
    poison_bwd_kernel[(B * H,)](
        ff, fb, g, resets, dq, dk, dv, dg, dh0, T2 - 2, H, K, V, G=HQ // H, BLOCK=BLOCK, BD=BD,
        HAS_G=g is not None, HAS_R=resets is not None, HAS_INIT=dh0 is not None, num_warps=4,
    )
