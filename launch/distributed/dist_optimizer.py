"""``--use-distributed-optimizer``: the fp32 master weights, their gradients and
AdamW's two moments sharded over the data- and context-parallel ranks, with torch's
FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank keeps rows ``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of dim 0 of every
(TP-local) fp32 parameter as a ``DTensor`` over a one-dimensional mesh of the DP x CP
group (W ranks); AdamW steps those shards. In the forward FSDP all-gathers the
shards into whole weights of the model's dtype (``MixedPrecisionPolicy.param_dtype``:
bf16/fp16 with ``--bf16``/``--fp16``, else fp32), keeps them through the backward
(``reshard_after_forward=False``: weights whole during the step, as Megatron's
distributed optimizer) and reduce-scatters each microbatch's gradients in fp32,
summed (the trainer's loss is already the global token mean).

Why FSDP2 and not megatron-core's ``DistributedOptimizer``: see docs/launch.md
("The distributed optimizer"); in short megatron-core 0.16's buffers and type checks
are CUDA-only, FSDP2 runs the same code on gloo/CPU and NCCL/CUDA.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# the attributes megatron-core reads off a parameter (TP split, duplicates, sharing);
# FSDP2 makes new Parameter objects, so they are carried over
_MEGATRON_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                   "sequence_parallel", "shared", "shared_embedding", "allreduce")


COMPUTE_DTYPE = "hla_sp_compute_dtype"
# the checkpoint's description of the model before sharding (keys, TP offsets)
UNSHARDED_LAYOUT = "hla_sp_unsharded_layout"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a ``DTensor``), else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_model(model: torch.nn.Module, group: Any, compute_dtype: torch.dtype,
                layout: Any) -> None:
    """Shard ``model`` in place over ``group`` (DP x CP): its parameters become fp32
    shards (rounded from their ``compute_dtype`` values, as the unsharded run's
    masters are), gathered as ``compute_dtype`` weights for each step. ``layout`` is
    the checkpoint's description of the unsharded model (``describe_model``), from
    which its pieces are cut."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    attrs = {name: {a: getattr(p, a) for a in _MEGATRON_ATTRS if hasattr(p, a)}
             for name, p in model.named_parameters()}
    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # one unit a transformer layer, then the rest: a layer's gradients are reduced as
    # the backward leaves it, so the fp32 copy the reduce-scatter needs is one layer's
    layers = list(getattr(getattr(model, "decoder", None), "layers", []))
    for unit in [*layers, model]:
        for p in unit.parameters():
            if not isinstance(p, DTensor):
                # fp32 masters start from the half weights, as MasterWeights does (a
                # unit at a time: one unit's whole fp32 copy at once); buffers keep
                # the model's dtype, which FSDP does not cast
                p.data = p.data.float()
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    for unit in _units(model):
        # a plain sum of the gradients: gloo has no PREMUL_SUM, and the loss is
        # already divided by the global token count
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    for name, p in model.named_parameters():
        for a, v in attrs[name].items():
            setattr(p, a, v)
    # GPTModel returns its per-token loss as a view; FSDP warns (once a rank a run) that an
    # in-place op on that view would skip its gradient hook. The trainer reads the output
    # only out of place ((per_token.float() * mask).sum()), and the sharded run's losses
    # and weights equal the unsharded run's (tests/integration/test_dist_optimizer.py), so the
    # warning would only be two lines of noise a rank on the user's console.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # what the checkpoint writes as the model's weights (the masters rounded to it)
    setattr(model, COMPUTE_DTYPE, compute_dtype)
    setattr(model, UNSHARDED_LAYOUT, layout)


def half_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The half dtype a sharded model computes in (its parameters are the fp32
    masters), else None."""
    dtype = getattr(model, COMPUTE_DTYPE, None)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def at_rest(model: torch.nn.Module) -> None:
    """A sharded model's parameters back to their shards (FSDP keeps the whole weights
    after a step's forward and backward); nothing for another model."""
    for unit in _units(model):
        unit.reshard()


def _units(model: torch.nn.Module) -> list[Any]:
    """The FSDP units of ``model`` (none for a model that is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first row, row count) of this rank's shard in dim 0 of ``p``'s whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return 0, p.shape[0] if p.dim() else 1
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                          p.placements)
    return (offset[0], shape[0]) if shape else (0, 1)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of the optimizer: the tensors it steps (fp32 masters, or
    the parameters of an fp32 run) and their per-parameter state (Adam's moments)."""
    total = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            for t in [p, *optimizer.state.get(p, {}).values()]:
                if isinstance(t, torch.Tensor) and t.dim() > 0:  # not the step count
                    total += local(t).numel() * t.element_size()
    return total
