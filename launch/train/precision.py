"""Mixed precision as Megatron does it: half-precision model, fp32 master weights and grads.

With ``--bf16`` or ``--fp16`` the model's weights and activations are half precision
(``TransformerConfig.params_dtype``); the optimizer steps fp32 copies of the weights
(the *master* weights) and copies them back into the model after every step. Each
microbatch's half gradients are added into fp32 gradients of the masters at once, so
accumulation, the data-parallel all-reduce, clipping and the optimizer all run in fp32
(Megatron's ``Float16OptimizerWithFloat16Params`` with fp32 gradient accumulation).

``--fp16`` adds a loss scale (Megatron's ``DynamicGradScaler``, or a constant with
``--loss-scale``): the loss is multiplied by it before backward, the fp32 gradients are
divided by it, and a step whose gradients hold an inf or NaN is skipped while the
dynamic scale backs off. With fp32 (no flag) the masters *are* the model's parameters
and nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hla_sp.launch.distributed.dist_optimizer import local


class LossScaler:
    """Megatron's dynamic loss scale: halve after ``hysteresis`` overflowing steps (not
    below ``min_scale``), double after ``window`` steps without one; or a constant."""

    def __init__(
        self,
        static: float | None,
        initial: float = 2.0**32,
        min_scale: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
    ):
        self.dynamic = static is None
        self.scale = float(initial if static is None else static)
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self._growth, self._hyst = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (with hysteresis), grow after a clean window."""
        if not self.dynamic:
            return
        if found_inf:
            self._growth = 0
            self._hyst -= 1
            if self._hyst <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self._growth += 1
            if self._growth == self.window:
                self._growth, self._hyst = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth": self._growth, "hysteresis": self._hyst}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth, self._hyst = int(state["growth"]), int(state["hysteresis"])


class MasterWeights:
    """The model's trainable parameters and the fp32 tensors the optimizer steps."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.half = any(p.dtype in (torch.float16, torch.bfloat16) for p in self.params)
        if self.half:
            self.main = [p.detach().float().clone() for p in self.params]
            for m in self.main:
                m.grad = torch.zeros_like(m)
        else:
            self.main = self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.half:
            for m in self.main:
                m.grad.zero_()  # type: ignore[union-attr]
        else:
            for m in self.main:
                m.grad = None

    def accumulate(self) -> None:
        """Move this microbatch's half gradients into the fp32 ones (fp32: nothing)."""
        if not self.half:
            return
        for p, m in zip(self.params, self.main):
            if p.grad is not None:
                m.grad.add_(p.grad.float())  # type: ignore[union-attr]
                p.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients, zeros for parameters that got none."""
        out = []
        for m in self.main:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            out.append(m.grad)
        return out

    def unscale_and_check(self, scale: float) -> bool:
        """Divide the gradients by ``scale``; True if any rank's hold an inf or NaN."""
        grads = self.grads()
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        for g in grads:
            g.mul_(1.0 / scale)
            # a sharded gradient (--use-distributed-optimizer): this rank's rows
            found += (~torch.isfinite(local(g))).any().float()
        # tensor-parallel ranks hold different slices: every rank must skip together
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def copy_to_model(self) -> None:
        """After the optimizer step: the masters, rounded, become the model's weights."""
        if self.half:
            with torch.no_grad():
                for p, m in zip(self.params, self.main):
                    p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters (empty for fp32 runs, whose masters are the model's own)."""
        return {"main_params": [m.detach().clone() for m in self.main]} if self.half else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.half:
            return
        saved = state.get("main_params")
        if saved is None:  # a checkpoint without masters: start them from the model
            with torch.no_grad():
                for p, m in zip(self.params, self.main):
                    m.copy_(p.float())
            return
        with torch.no_grad():
            for m, s in zip(self.main, saved):
                m.copy_(s)
