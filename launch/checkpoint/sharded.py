"""Model and optimizer tensors as pieces of global tensors, written and read with
``torch.distributed.checkpoint`` (DCP), so that a checkpoint loads at another TP, CP or
DP size.

megatron-core describes each tensor of its model (``sharded_state_dict()``): a key, the
global shape, where this rank's piece sits in it, and whether this rank holds the main
replica (DP and CP ranks hold copies, and so do TP ranks of the tensors TP does not
split). Optimizer moments and fp32 master weights have their parameter's shape, so they
take its description under megatron's keys (``optimizer.state.exp_avg.<key>``,
``optimizer.state.fp32_param.<key>``). Each rank hands DCP its main-replica pieces to
write; on load, DCP reads for every piece this rank holds its overlaps with the saved
pieces, which is the resharding.

The files are written by plain DCP with two small planners, not by megatron's
``dist_checkpointing.save``, whose ``torch_dist`` strategy ends on a CUDA device
(``torch.cuda.current_device()``) that a CPU run does not have. The directory is a
standard DCP checkpoint (``.metadata`` and ``__R_0.distcp`` files), so
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one
``torch.save`` file of whole tensors.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from hla_sp.launch.checkpoint.layout import CheckpointError, write_error
from hla_sp.launch.distributed.dist_optimizer import UNSHARDED_LAYOUT, at_rest, local, shard_rows
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

MOMENT, MASTER = "optimizer.state", "optimizer.state.fp32_param"


@dataclasses.dataclass
class Piece:
    """This rank's piece of one global tensor."""

    key: str  # the global tensor's name in the checkpoint
    tensor: torch.Tensor  # the piece (sharing the live tensor's storage), global ndim
    offsets: tuple[int, ...]  # where it starts in the global tensor
    global_shape: tuple[int, ...]
    main: bool  # this rank writes it (the main replica)
    padded: bool  # vocabulary rows, padded per TP size: another global size loads the overlap

    def like(self, prefix: str, tensor: torch.Tensor) -> Piece:
        """The same place in ``tensor`` (a moment, a master: the parameter's shape)."""
        return dataclasses.replace(self, key=f"{prefix}.{self.key}",
                                   tensor=local(tensor.detach()).view(self.tensor.shape))


@dataclasses.dataclass
class ModelPieces:
    """The model's pieces, and each trainable parameter's name and piece."""

    pieces: list[Piece]
    params: list[torch.Tensor]  # trainable, in ``model.parameters()`` order
    names: list[str]  # each one's name in the model, the same at every TP size
    of_param: list[Piece]


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def parallel_sizes() -> tuple[int, int]:
    """This process's tensor- and context-parallel sizes: megatron-core's groups when
    they exist, else (1, 1)."""
    # megatron-core never imported means no groups: a plain module's save stays cheap
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return 1, 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without megatron-core's groups)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return 0
    return ps.get_tensor_model_parallel_rank()


def describe_model(model: torch.nn.Module, writes: bool) -> ModelPieces:
    """Every tensor of ``model`` as a piece: from megatron's ``sharded_state_dict``, or
    (a plain module) each whole tensor, written by the ranks where ``writes`` holds."""
    whole = getattr(model, UNSHARDED_LAYOUT, None)
    if whole is not None:
        at_rest(model)
        return _sharded(model, whole)
    by_id: dict[int, tuple[str, Piece]] = {}
    pieces = []
    if hasattr(model, "sharded_state_dict"):
        from megatron.core.dist_checkpointing.mapping import (
            ShardedObject,
            ShardedTensor,
            is_main_replica,
        )

        for name, sh in _flat(model.sharded_state_dict()):
            if isinstance(sh, ShardedObject) and sh.data is None:
                continue  # the empty _extra_state of megatron's local layers
            if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
                raise CheckpointError(
                    f"model entry {name}: expected a whole ShardedTensor, got a "
                    f"{type(sh).__name__}; this trainer's checkpoints hold tensors only")
            shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            piece = Piece(sh.key, sh.data.detach().view(shape), tuple(sh.global_offset),
                          tuple(sh.global_shape), is_main_replica(sh.replica_id),
                          bool(sh.allow_shape_mismatch))  # fmt: skip
            pieces.append(piece)
            by_id[id(sh.data)] = (name, piece)
    else:
        tp = parallel_sizes()[0]
        if tp > 1:  # every rank sees the same size: all refuse together
            raise CheckpointError(
                f"{type(model).__name__} has no sharded_state_dict: its tensors cannot be "
                f"placed in global ones at tensor-parallel size {tp}")
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                piece = Piece(name, t.detach(), (0,) * t.dim(), tuple(t.shape), writes, False)
                pieces.append(piece)
                by_id[id(t)] = (name, piece)
    params = [p for p in model.parameters() if p.requires_grad]
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise CheckpointError(
            f"model parameter {missing[0]} (shape {tuple(params[missing[0]].shape)}) is not "
            f"in the model's sharded_state_dict, so it would not be saved")
    return ModelPieces(pieces, params, [by_id[id(p)][0] for p in params],
                       [by_id[id(p)][1] for p in params])


def unsharded_layout(model: torch.nn.Module) -> ModelPieces:
    """``describe_model`` of a model about to be sharded, its parameters' pieces holding
    only their shapes (meta tensors): what :func:`_sharded` cuts the pieces from,
    without keeping the whole weights alive."""
    d = describe_model(model, writes=False)
    meta = {id(pc): dataclasses.replace(pc, tensor=pc.tensor.to("meta")) for pc in d.of_param}
    return ModelPieces([meta.get(id(pc), pc) for pc in d.pieces], [], d.names,
                       [meta[id(pc)] for pc in d.of_param])


def _sharded(model: torch.nn.Module, whole: ModelPieces) -> ModelPieces:
    """The pieces of a model sharded by --use-distributed-optimizer: each parameter's
    place as ``whole`` (described before sharding) gives it, cut to this rank's rows
    of its first dim. Every DP x CP rank writes its rows; of a tensor TP does not split
    TP rank 0 writes them."""
    params = [p for p in model.parameters() if p.requires_grad]
    own = {id(pc) for pc in whole.of_param}
    pieces = [pc for pc in whole.pieces if id(pc) not in own]  # buffers: unsharded
    of_param = []
    for p, pc in zip(params, whole.of_param):
        start, rows = shard_rows(p)
        dim = len(pc.tensor.shape) - p.dim()  # megatron's prepended axes
        offsets, shape = list(pc.offsets), tuple(pc.tensor.shape)
        if p.dim():
            offsets[dim] += start
            shape = (*shape[:dim], rows, *shape[dim + 1:])
        main = (getattr(p, "tensor_model_parallel", False) or tp_rank() == 0) and rows > 0
        of_param.append(dataclasses.replace(pc, tensor=local(p.detach()).view(shape),
                                            offsets=tuple(offsets), main=main))
    return ModelPieces(pieces + of_param, params, whole.names, of_param)


def _is_master_of(o: torch.Tensor, p: torch.Tensor) -> bool:
    if o is p:
        return True
    # an fp32 master always rounds to its half-precision weight: the trainer copies it
    # into the model after every step, and creates it from the model
    return (o.shape == p.shape and o.dtype != p.dtype
            and torch.equal(o.detach().to(p.dtype), p.detach()))  # fmt: skip


def match_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[int]:
    """For each tensor the optimizer steps (its groups in order), the index in ``params``
    of its model parameter: the parameter itself, or the first one not yet matched that
    it is the fp32 master of (the trainer's groups keep the model's order, so equal
    weights of one shape are matched in that order)."""
    index = {id(p): i for i, p in enumerate(params)}
    taken = [False] * len(params)
    out = []
    for group in optimizer.param_groups:
        for o in group["params"]:
            i = index.get(id(o))
            if i is None:
                i = next((j for j, p in enumerate(params)
                          if not taken[j] and _is_master_of(o, p)), None)  # fmt: skip
            if i is None or taken[i]:
                raise CheckpointError(
                    f"optimizer tensor {len(out)} (shape {tuple(o.shape)}): expected one of "
                    f"the model's trainable parameters or its fp32 master, found none")
            taken[i] = True
            out.append(i)
    return out


def optimizer_state(
    optimizer: torch.optim.Optimizer, model: ModelPieces
) -> tuple[list[Piece], dict[str, Any]]:
    """The optimizer's per-parameter tensors as pieces (named for the parameter), and the
    rest for rank 0's small file: group hyperparameters and per-parameter scalars (the
    step), keyed by the parameter's name, which is the same at every TP size."""
    order = match_optimizer(optimizer, model.params)
    flat = [o for g in optimizer.param_groups for o in g["params"]]
    pieces, scalars, moments = [], {}, set()
    for o, i in zip(flat, order):
        for k, v in optimizer.state.get(o, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == o.shape:
                moments.add(k)
                pieces.append(model.of_param[i].like(f"{MOMENT}.{k}", v))
            else:
                scalars.setdefault(model.names[i], {})[k] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return pieces, {"param_groups": groups, "moments": sorted(moments), "scalars": scalars}


def optimizer_targets(
    optimizer: torch.optim.Optimizer, model: ModelPieces, saved: dict[str, Any], where: str
) -> tuple[list[Piece], dict[str, Any]]:
    """Fresh tensors for the saved moments, as pieces to read into, and the optimizer
    state dict that holds them (for ``load_state_dict`` once they are read)."""
    order = match_optimizer(optimizer, model.params)
    now = optimizer.state_dict()["param_groups"]
    if len(now) != len(saved["param_groups"]):
        raise CheckpointError(
            f"{where}: the optimizer had {len(saved['param_groups'])} parameter groups, this "
            f"run's has {len(now)}")
    flat = [o for g in optimizer.param_groups for o in g["params"]]
    pieces, state = [], {}
    for idx, (o, i) in enumerate(zip(flat, order)):
        entry: dict[str, Any] = {}
        for k in saved["moments"]:
            entry[k] = torch.zeros_like(o, memory_format=torch.contiguous_format)
            pieces.append(model.of_param[i].like(f"{MOMENT}.{k}", entry[k]))
        entry.update(saved["scalars"].get(model.names[i], {}))
        if entry:
            state[idx] = entry
    groups = [{**g, **{k: v for k, v in s.items() if k != "params"}}
              for g, s in zip(now, saved["param_groups"])]  # fmt: skip
    return pieces, {"state": state, "param_groups": groups}


# --- DCP ------------------------------------------------------------------------------


class _Writer(DefaultSavePlanner):
    """Writes this rank's main-replica pieces, each a chunk at its global offsets."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(p.key, p.offsets): p for p in pieces if p.main}

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([
            WriteItem(
                index=MetadataIndex(p.key, torch.Size(p.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                               sizes=p.tensor.shape),
                    properties=TensorProperties.create_from_tensor(p.tensor),
                    size=torch.Size(p.global_shape),
                ),
            )
            for p in self._pieces.values()
        ])  # fmt: skip
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._pieces[(index.fqn, tuple(index.offset))].tensor


class _Reader(DefaultLoadPlanner):
    """Reads into each piece its overlaps with the saved chunks of its global tensor."""

    def __init__(self, pieces: list[Piece], where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(p.key, p.offsets): p for p in pieces}
        self._where = where

    def create_local_plan(self) -> LoadPlan:
        by_key: dict[str, list[Piece]] = {}
        for p in self._pieces.values():
            by_key.setdefault(p.key, []).append(p)
        items = []
        for key, pieces in by_key.items():
            md = self.metadata.state_dict_metadata.get(key) if self.metadata else None
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"{self._where}: holds no tensor {key}; the checkpoint is of another "
                    f"model, or was written without that state")
            if tuple(md.size) != pieces[0].global_shape:
                if not pieces[0].padded:
                    raise CheckpointError(
                        f"{self._where}: {key} is {tuple(md.size)} in the checkpoint, this "
                        f"model's is {pieces[0].global_shape}")
                for p in pieces:  # padding rows the checkpoint has not: zero, as megatron
                    p.tensor.zero_()
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape)
                      for p in pieces]  # fmt: skip
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(index.fqn, tuple(index.offset))].tensor


def _cause(e: BaseException) -> BaseException:
    """A rank's own error inside DCP's ``CheckpointException`` (which gathers every
    rank's failures, each an (exception, traceback) pair)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return _cause(first)
    return e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _state(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    # what DCP is handed as the state dict; the planners look pieces up by (key, offsets)
    return {f"{p.key}@{p.offsets}": p.tensor for p in pieces}


def write(path: str, pieces: list[Piece]) -> None:
    """Write ``pieces`` (collective: every rank calls it) into the DCP directory ``path``."""
    try:
        dcp.save(_state([p for p in pieces if p.main]),
                 storage_writer=dcp.FileSystemWriter(path), planner=_Writer(pieces))
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        cause = _cause(e)
        if isinstance(cause, OSError):
            raise write_error(cause, path) from e
        if cause is e and isinstance(e, Exception):
            raise
        raise CheckpointError(f"{path}: writing the model and optimizer state failed "
                              f"({type(cause).__name__}: {_first_line(cause)})") from e


def read(path: str, pieces: list[Piece]) -> None:
    """Fill ``pieces`` from the DCP directory ``path`` (collective), whatever sizes of TP,
    CP and DP wrote it. A padded vocabulary of another size (the padding follows the TP
    size) loads the rows both have and starts the others at zero, as Megatron does: the
    padding ids take no probability (the model gives them -inf logits), so the model's
    function is unchanged and nothing needs saying."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{os.path.join(path, '.metadata')}: missing (the index of the "
                              f"model and optimizer state)")
    planner = _Reader(pieces, path)
    try:
        dcp.load(_state(pieces), storage_reader=dcp.FileSystemReader(path), planner=planner)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        cause = _cause(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from e
        raise CheckpointError(
            f"{path}: cannot read the model and optimizer state ({type(cause).__name__}: "
            f"{_first_line(cause)}); the files are truncated or corrupt: resume from "
            f"another iteration with --ckpt-step") from e
