"""The chunk-parallel PyTorch path of the primitive, decayed causal linear attention.

Inside a chunk of C tokens the work is masked matmuls; between chunks a state of
size K x V is passed on. This is the algebra of the segment summaries (docs/math.md
section 4) with chunks in place of ranks:

    summary of chunk n:   s_n = sum_j exp(b_C - b_j) k_j v_j^T,  pass factor p_n = exp(b_C)
    state after chunk n:  h_n = p_n h_{n-1} + s_n
    output:               o_t = sum_{j<=t in chunk} exp(b_t - b_j)(q_t.k_j) v_j
                              + exp(b_t) q_t h_{n-1}

with b the within-chunk cumulative log-decay. Cost O(T C (K + V) + T K V) time and
O(T (C + K + V)) memory. Autograd differentiates it exactly; the Triton path in
``hla_sp.kernels`` has hand-written backward kernels instead.

Document starts (``resets``) cut the carry, which is the summary's "contains a
start" flag: pairs across a start are masked, and a chunk containing a start passes
on only the part after its last start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def document_resets(bounds: Sequence[int], T: int, device: torch.device) -> torch.Tensor:
    """[1, T] bool ``resets``: True at every document start but the first.

    Args:
        bounds: the document offsets as Python ints, [N + 1] (cu_seqlens.tolist()).
    """
    resets = torch.zeros(1, T, dtype=torch.bool, device=device)
    resets[0, list(bounds[1:-1])] = True
    return resets


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    resets: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed causal linear attention, chunk-parallel.

    Args:
        q: [B, T, H, K], already multiplied by the scale.
        k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H] log-decay (<= 0), or None for no decay.
        resets: [B, T] bool, True where a new segment starts (its carry is cut);
            position 0 must be False: the carry into position 0 is ``h0``.
        h0: [B, H, K, V] carry into position 0, or None for zero.
        chunk_size: C, the chunk length.

    Returns:
        o: [B, T, H, V] in q's dtype, and the state after the last token,
        [B, H, K, V] in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    cdt = compute_dtype(q.dtype)
    if T == 0:  # an empty shard: no outputs, and the carry passes through unchanged
        h = torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None else h0.to(cdt)
        return q.new_zeros(B, 0, H, V, dtype=cdt), h
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    g = torch.zeros(B, T, H, dtype=cdt, device=q.device) if g is None else g.to(cdt)
    if pad:
        # Padding at the end with q = k = v = 0 and g = 0 leaves the state unchanged.
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
    # [B, H, N, C, D] so that each chunk is a batched matmul.
    qc = q.view(B, N, C, H, K).permute(0, 3, 1, 2, 4)
    kc = k.view(B, N, C, H, K).permute(0, 3, 1, 2, 4)
    vc = v.view(B, N, C, H, V).permute(0, 3, 1, 2, 4)
    b = g.view(B, N, C, H).permute(0, 3, 1, 2).cumsum(-1)  # [B, H, N, C]
    bC = b[..., -1:]  # [B, H, N, 1]

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    keep = causal  # [C, C] or [B, 1, N, C, C]
    w_state = torch.exp(bC - b)  # weight of token j in its chunk's summary
    w_carry = torch.exp(b)  # weight of the incoming state for token t
    p = torch.exp(bC[..., 0])  # [B, H, N] pass factor of each chunk
    if resets is not None:
        r = resets.to(torch.bool)
        if pad:
            r = F.pad(r, (0, pad))
        c = r.view(B, N, C).long().cumsum(-1)[:, None]  # starts seen so far in the chunk
        keep = causal & (c[..., :, None] == c[..., None, :])
        w_state = w_state * (c == c[..., -1:])
        w_carry = w_carry * (c == 0)
        p = p * (c[..., -1] == 0)

    diff = (b[..., :, None] - b[..., None, :]).masked_fill(~keep, float("-inf"))
    attn = (qc @ kc.transpose(-1, -2)) * torch.exp(diff)  # [B, H, N, C, C]
    o = attn @ vc  # [B, H, N, C, V]

    s = (kc * w_state[..., None]).transpose(-1, -2) @ vc  # [B, H, N, K, V]
    h = torch.zeros(B, H, K, V, dtype=cdt, device=q.device) if h0 is None else h0.to(cdt)
    incoming = []
    # unbind, not s[:, :, n]: the backward of an index is a zero tensor the size of s
    # per chunk, which made the backward O(N^2 K V).
    for p_n, s_n in zip(p.unbind(-1), s.unbind(2)):
        incoming.append(h)
        h = p_n[..., None, None] * h + s_n
    h_in = torch.stack(incoming, dim=2)  # [B, H, N, K, V]
    o = o + (qc * w_carry[..., None]) @ h_in

    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, h


def segment_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of a whole segment from a zero state: one weighted K^T V.

    Args:
        k: [B, L, H, K], v: [B, L, H, V], g: [B, L, H] or None.

    Returns:
        h: [B, H, K, V] = sum_j exp(A_L - A_j) k_j v_j^T (compute dtype), and
        a: [B, H], the segment's total log-decay A_L.
    """
    cdt = compute_dtype(k.dtype)
    k, v = k.to(cdt), v.to(cdt)
    B, _L, H, _ = k.shape
    if g is None:
        return torch.einsum("blhk,blhv->bhkv", k, v), torch.zeros(B, H, dtype=cdt, device=k.device)
    # exp(A_L - A_j) as the exp of a suffix sum: A_L - A_j cancels catastrophically
    # in fp32 once |A_L| is large (a long shard: |A_L| ~ 1e4 costs ~1e-3 relative).
    suffix = g.to(cdt).flip(1).cumsum(1).flip(1)  # [B, L, H]: sum_{i >= j} g_i
    total = suffix[:, 0]
    w = torch.exp(F.pad(suffix[:, 1:], (0, 0, 0, 1)))  # sum_{i > j} g_i
    return torch.einsum("blhk,blhv->bhkv", k * w[..., None], v), total


def carry_term(q: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor) -> torch.Tensor:
    """What a carry-in state adds to a segment's outputs: exp(A_t) q_t^T h0.

    Args:
        q: [B, L, H, K] (scaled), g: [B, L, H] or None, h0: [B, H, K, V].

    Returns:
        [B, L, H, V] in the compute dtype.
    """
    cdt = compute_dtype(q.dtype)
    out = torch.einsum("blhk,bhkv->blhv", q.to(cdt), h0.to(cdt))
    if g is not None:
        out = out * torch.exp(g.to(cdt).cumsum(1))[..., None]
    return out
