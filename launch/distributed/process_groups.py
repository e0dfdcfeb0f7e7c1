"""Process groups: NCCL when CUDA is present, gloo otherwise; CP/DP/TP from megatron-core."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for single-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



def parallel_state() -> ModuleType:
    """megatron-core's ``parallel_state`` (the parallel groups), imported on first use:
    with :func:`tensor_parallel`, launch's one import of it (the megatron extra)."""
    from megatron.core import parallel_state as ps

    return ps


def tensor_parallel() -> ModuleType:
    """megatron-core's ``tensor_parallel`` (TP regions and attributes), on first use."""
    from megatron.core import tensor_parallel as tp

    return tp


@dataclass
class Topology:
    """Where this rank sits: global rank and its coordinates in the TP/CP/DP grid."""

    rank: int
    world_size: int
    tp: int
    cp: int
    dp: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    device: torch.device
    owns_process_group: bool  # False when Ray (or a caller) created it

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def cp_group(self) -> Any:
        """Megatron's context-parallel process group of this rank (a world of one at CP 1)."""
        return parallel_state().get_context_parallel_group()


def init_distributed(tp: int, cp: int, timeout_minutes: float) -> Topology:
    """Join (or create) the default process group and build Megatron's parallel groups.

    Under torchrun the environment carries the rendezvous; a plain ``python -m`` run
    becomes a world of one on a free local port. If a process group exists already
    (Ray Train makes one), it is used as is.
    """
    ps = parallel_state()

    cuda = torch.cuda.is_available()
    owns = not dist.is_initialized()
    if owns:
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
            )
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", timeout=timedelta(minutes=timeout_minutes)
        )
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_minutes,
        # on CPU the main groups are gloo already; duplicates would only slow start-up
        create_gloo_process_groups=cuda,
    )
    world = dist.get_world_size()
    return Topology(
        rank=dist.get_rank(),
        world_size=world,
        tp=tp,
        cp=cp,
        dp=world // (tp * cp),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        owns_process_group=owns,
    )


def shutdown(topo: Topology) -> None:
    """Tear down Megatron's groups, and the default group if we made it."""
    parallel_state().destroy_model_parallel()
    if topo.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
