"""Input checks shared by every public operator.

Every check runs before any arithmetic, and every error names the argument, what
was expected and what was received.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hla_sp.ops.sharding import BatchPlan, bounds_digest, check_bounds, documents_bounds

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(exc: type[Exception], arg: str, expected: str, got: object) -> None:
    raise exc(f"{arg}: expected {expected}, got {got}")


def check_tensor(name: str, x: object, ndim: int, layout: str) -> torch.Tensor:
    """Check that ``x`` is a floating tensor of rank ``ndim`` (``layout`` names the dims)."""
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in FLOAT_DTYPES:
        _fail(TypeError, name, "a floating dtype (float16, bfloat16, float32, float64)", x.dtype)
    if x.dim() != ndim:
        _fail(ValueError, name, f"a {ndim}-D tensor {layout}", f"shape {tuple(x.shape)}")
    return x


def check_qkv(
    q: object, k: object, v: object, *, value_name: str = "v", allow_empty: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]. Same dtype and device; T >= 1 unless allowed."""
    q = check_tensor("q", q, 4, "[B, T, H, K]")
    k = check_tensor("k", k, 4, "[B, T, H, K]")
    v = check_tensor(value_name, v, 4, "[B, T, H, V]")
    if k.shape != q.shape:
        _fail(ValueError, "k", f"shape {tuple(q.shape)} (the shape of q)", f"{tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        _fail(
            ValueError,
            value_name,
            f"leading dims [B, T, H] = {tuple(q.shape[:3])} (those of q)",
            f"{tuple(v.shape[:3])}",
        )
    for name, x in (("k", k), (value_name, v)):
        if x.dtype != q.dtype:
            _fail(TypeError, name, f"dtype {q.dtype} (the dtype of q)", x.dtype)
        if x.device != q.device:
            _fail(ValueError, name, f"device {q.device} (the device of q)", x.device)
    if q.shape[1] == 0 and not allow_empty:
        _fail(ValueError, "q", "a sequence length T >= 1", "T = 0")
    if q.shape[0] == 0 or q.shape[2] == 0 or q.shape[3] == 0:
        _fail(ValueError, "q", "non-zero B, H and K", f"shape {tuple(q.shape)}")
    if v.shape[3] == 0:
        _fail(ValueError, value_name, "a non-zero value dim V", f"shape {tuple(v.shape)}")
    return q, k, v


def check_bool(name: str, value: object) -> bool:
    """A plain bool option."""
    if not isinstance(value, bool):
        _fail(TypeError, name, "a bool", type(value).__name__)
    return value  # type: ignore[return-value]


def check_nonneg(name: str, value: object) -> float:
    """A finite float option >= 0 (eps, ridge): inf or NaN would make every output NaN or 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(TypeError, name, "a finite float >= 0", type(value).__name__)
    if not (value >= 0 and math.isfinite(value)):  # type: ignore[operator,arg-type]
        _fail(ValueError, name, "a finite float >= 0", repr(value))
    return float(value)  # type: ignore[arg-type]


def check_pos_int(name: str, value: object) -> int:
    """A positive int (sizes, head counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(ValueError, name, "a positive int", repr(value))
    return value  # type: ignore[return-value]


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of a fixed set of names."""
    if not isinstance(value, str) or value not in choices:
        _fail(ValueError, name, f"one of {choices}", repr(value))
    return value  # type: ignore[return-value]


def check_scale(scale: float | None, head_dim: int) -> float:
    """Return the query scale, defaulting to K ** -0.5."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail(TypeError, "scale", "a float or None", type(scale).__name__)
    if not math.isfinite(scale):
        _fail(ValueError, "scale", "a finite float or None", repr(scale))
    return float(scale)


def _no_values(x: torch.Tensor) -> bool:
    """True for a tensor without data: on the meta device, or a fake tensor (FakeTensorMode,
    as torch.compile, FSDP2 and FLOP counters trace with): value checks are skipped."""
    from torch._subclasses.fake_tensor import is_fake

    return x.device.type == "meta" or is_fake(x)


def _physical(x: torch.Tensor) -> torch.Tensor:
    """The tensor under ``torch.vmap``'s wrappers (every level's batch, one host read for
    all of them); x itself outside vmap."""
    from torch._C import _functorch as ft

    while ft.is_batchedtensor(x):
        x = ft.get_unwrapped(x)
    return x


def check_log_decay(
    log_decay: object, q: torch.Tensor, *, check_values: bool = True
) -> torch.Tensor | None:
    """Broadcast ``log_decay`` to [B, T, H]; an [H] tensor is a per-head constant.

    Values must be <= 0 (gamma = exp(a) <= 1), so every state stays bounded.
    """
    if log_decay is None:
        return None
    B, T, H, _ = q.shape
    if not isinstance(log_decay, torch.Tensor):
        _fail(TypeError, "log_decay", "a torch.Tensor or None", type(log_decay).__name__)
    assert isinstance(log_decay, torch.Tensor)
    if not log_decay.is_floating_point():
        _fail(TypeError, "log_decay", "a floating dtype", log_decay.dtype)
    if log_decay.device != q.device:
        _fail(ValueError, "log_decay", f"device {q.device} (the device of q)", log_decay.device)
    try:
        g = torch.broadcast_to(log_decay, (B, T, H))
    except RuntimeError:
        _fail(
            ValueError,
            "log_decay",
            f"a shape that broadcasts to [B, T, H] = [{B}, {T}, {H}] (e.g. [H] or [B, T, H])",
            f"shape {tuple(log_decay.shape)}",
        )
    if check_values and log_decay.numel() > 0 and (
        torch.compiler.is_compiling()
        or (log_decay.device.type != "cpu" and not _no_values(log_decay))
    ):
        # .item() would break a torch.compile graph, and on a GPU it would wait for the
        # device on every call (a host sync): the same check runs on the device instead,
        # with no wait, and fails the call's stream (a RuntimeError at the next sync).
        torch._assert_async(
            log_decay.detach().max() <= 0.0,
            "log_decay: expected values <= 0 (gamma = exp(log_decay) <= 1)",
        )
    elif check_values and log_decay.numel() > 0 and not _no_values(log_decay):
        # (meta and fake tensors, for initialisation and FLOP counting, hold no values)
        mx = _physical(log_decay.detach()).max().item()
        if not mx <= 0.0:  # also catches NaN
            _fail(ValueError, "log_decay", "values <= 0 (gamma = exp(log_decay) <= 1)", f"max {mx}")
    return g


def check_cu_seqlens(
    cu_seqlens: object, q: torch.Tensor, *, total: int | None
) -> tuple[int, ...] | None:
    """Packed documents: int tensor [N + 1], 0 = c_0 < ... < c_N = total, with B == 1.
    Returns the offsets as Python ints (one host read).

    ``total`` is T on one process; None skips the end check (sequence parallelism,
    where the global length is checked across ranks).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(TypeError, "cu_seqlens", "a 1-D integer torch.Tensor", type(cu_seqlens).__name__)
    assert isinstance(cu_seqlens, torch.Tensor)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, "cu_seqlens", "dtype int32 or int64", cu_seqlens.dtype)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(
            ValueError, "cu_seqlens", "a 1-D tensor of N + 1 >= 2 offsets", tuple(cu_seqlens.shape)
        )
    _check_packed(q, "cu_seqlens is given")
    bounds = documents_bounds(cu_seqlens)
    assert bounds is not None
    check_bounds(bounds, total)
    return bounds


def _check_packed(q: torch.Tensor, why: str) -> None:
    if q.shape[0] != 1:
        _fail(ValueError, "q", f"batch size B == 1 when {why} (packed layout)",
              f"B = {q.shape[0]}")


def check_documents(
    cu_seqlens: object, plan: object, q: torch.Tensor, *, sp: object
) -> BatchPlan | None:
    """The documents of a call as its batch's :class:`BatchPlan`, given as offsets
    (``cu_seqlens``, read on the host once and planned here) or as the plan itself
    (``plan=``, read without any host synchronization); None for no documents."""
    if plan is not None:
        if cu_seqlens is not None:
            _fail(ValueError, "cu_seqlens", "None when plan is given (the plan holds the "
                  "documents)", "a tensor as well")
        if not isinstance(plan, BatchPlan):
            _fail(TypeError, "plan", "a BatchPlan (hla_sp.ops.sharding.plan_documents or "
                  "SequenceParallel.plan_batch)", type(plan).__name__)
        assert isinstance(plan, BatchPlan)
        plan.check_shard(q)
        if sp is None and plan.T_local != plan.T:
            _fail(ValueError, "plan", "a one-process plan (T = T_local) without sp", f"a "
                  f"plan of a sharded batch (T = {plan.T}, T_local = {plan.T_local})")
        return plan
    T = q.shape[1]
    bounds = check_cu_seqlens(cu_seqlens, q, total=None if sp is not None else T)
    if bounds is None:
        return None
    return BatchPlan(T_local=T, T=T if sp is None else bounds[-1], bounds=bounds,
                     digest=bounds_digest(bounds), lengths=(T,) if sp is None else ())


def check_state(
    name: str, x: object, expected: tuple[int, ...], q: torch.Tensor
) -> torch.Tensor | None:
    """A state tensor of an exact shape, float dtype, on q's device."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, f"a torch.Tensor of shape {list(expected)}", type(x).__name__)
    assert isinstance(x, torch.Tensor)
    if not x.is_floating_point():
        _fail(TypeError, name, "a floating dtype", x.dtype)
    if tuple(x.shape) != tuple(expected):
        _fail(ValueError, name, f"shape {list(expected)}", f"shape {list(x.shape)}")
    if x.device != q.device:
        _fail(ValueError, name, f"device {q.device} (the device of q)", x.device)
    return x


def check_chunk_size(chunk_size: object, T: int | None = None) -> int:
    """Chunk length of the chunk-parallel path: a positive power of two.

    Given the sequence length ``T``, the result is capped at the least power of two
    >= T: one chunk holds the whole sequence either way, so the result is the same,
    and a huge chunk_size does not allocate chunk_size^2 scores.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        _fail(TypeError, "chunk_size", "an int", type(chunk_size).__name__)
    assert isinstance(chunk_size, int)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        _fail(ValueError, "chunk_size", "a positive power of two", chunk_size)
    if T is not None:
        chunk_size = min(chunk_size, 1 << max(T - 1, 0).bit_length())
    return chunk_size


def check_symmetric(name: str, x: torch.Tensor) -> None:
    """A key moment S0 [..., K, K] must be symmetric: S_t = sum exp(.) k k^T is, and the
    operators read S q = S^T q only for a symmetric S. Checked per matrix, to a rounding
    tolerance (sqrt(eps) of the matrix's largest entry), so a state returned by an
    earlier call, summed in another order, passes."""
    if x.numel() == 0 or torch.compiler.is_compiling() or _no_values(x):
        return  # .item() would break the graph; states made by the operators are symmetric
    xd = x.detach()
    asym = (xd - xd.transpose(-1, -2)).abs().amax(dim=(-2, -1))
    tol = torch.finfo(xd.dtype).eps ** 0.5 * xd.abs().amax(dim=(-2, -1))
    bad = ~(asym <= tol)  # NaN counts as bad
    if x.device.type != "cpu":
        # on a GPU, checked on the device: no host sync on the call path (a RuntimeError
        # at the next sync, without the per-matrix detail)
        torch._assert_async(~bad.any(), f"{name}: expected a symmetric key moment "
                            "(S == S^T, as every state the operators return)")
        return
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        _fail(
            ValueError,
            name,
            "a symmetric key moment (S == S^T, as every state the operators return)",
            f"max |S - S^T| = {asym[idx].item():.3g} against max |S| = "
            f"{xd.abs().amax(dim=(-2, -1))[idx].item():.3g} at [n, h] = {list(idx)}",
        )


def check_state_tuple(
    state: object, fields: Mapping[str, tuple[int, ...] | None], q: torch.Tensor
) -> list[torch.Tensor | None]:
    """An operator's initial state, field by field (a None shape: absent for these options).

    A field named ``S`` (the key moment) must also be symmetric.
    """
    names = list(fields)
    if state is None:
        return [None] * len(names)
    if not isinstance(state, (tuple, list)):
        _fail(TypeError, "initial_state", f"a tuple or list ({', '.join(names)})",
              type(state).__name__)
    assert isinstance(state, (tuple, list))
    want = [n for n in names if fields[n] is not None]
    if len(state) > len(names):
        _fail(ValueError, "initial_state", f"a tuple of at most {len(names)} fields "
              f"({', '.join(names)})", f"a {type(state).__name__} of {len(state)}")
    given = list(state) + [None] * (len(names) - len(state))
    missing = [n for n, x in zip(names, given) if x is None and fields[n] is not None]
    if missing:
        _fail(ValueError, "initial_state", f"the fields ({', '.join(want)})",
              f"a tuple of {len(state)} with None at {missing}")
    out: list[torch.Tensor | None] = []
    for name, x in zip(names, given):
        shape = fields[name]
        if shape is None:
            if x is not None:
                _fail(ValueError, f"initial_state.{name}", "None for these options", "a tensor")
            out.append(None)
            continue
        t = check_state(f"initial_state.{name}", x, shape, q)
        assert t is not None
        if name == "S":
            check_symmetric(f"initial_state.{name}", t)
        out.append(t)
    return out


@dataclass(frozen=True)
class Inputs:
    """Checked inputs of a public operator call."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    g: torch.Tensor | None  # [B, T, H] log-decay
    scale: float
    chunk_size: int
    B: int
    T: int
    H: int
    K: int
    V: int
    n_seq: int  # B, or N documents when packed
    plan: BatchPlan | None = None  # the batch's plan: its documents (None: none given)


def check_inputs(
    q: object,
    k: object,
    v: object,
    *,
    log_decay: object,
    scale: object,
    cu_seqlens: object,
    sp: object,
    chunk_size: object,
    value_name: str = "v",
    output_final_state: object = False,
    plan: object = None,
) -> Inputs:
    """Every single-process check of a public call, in one place.

    Under sequence parallelism (``sp`` given) a rank's shard may be empty, and
    ``cu_seqlens`` describes the global sequence, so its end is checked against the
    global length by the parallel layer instead. ``plan`` (a :class:`BatchPlan`)
    gives the documents instead of ``cu_seqlens``, with no host read.
    """
    q, k, v = check_qkv(q, k, v, value_name=value_name, allow_empty=sp is not None)
    B, T, H, K = q.shape
    sc = check_scale(scale, K)  # type: ignore[arg-type]
    # Under sp the sign is checked with the ranks' agreement, on the device (a check
    # of one rank's shard alone would raise on that rank only).
    g = check_log_decay(log_decay, q, check_values=sp is None)
    bp = check_documents(cu_seqlens, plan, q, sp=sp)
    cs = check_chunk_size(chunk_size, T)
    check_bool("output_final_state", output_final_state)
    n_seq = B if bp is None or bp.bounds is None else len(bp.bounds) - 1
    return Inputs(q, k, v, g, sc, cs, B, T, H, K, v.shape[-1], n_seq, bp)
