"""Ground truth: naive quadratic forms, serial recurrences and the paper's own loops.

Nothing here is fast. Every function reads like the definition it checks, takes
[B, T, H, K] tensors, a log-decay broadcastable to [B, T, H] (or None) and a
``scale`` that multiplies q, and computes in the inputs' dtype. The operator table
(:mod:`hla_sp.ops.operators`) names each operator's recurrence here as its reference.
"""

from __future__ import annotations

import torch


def _prep(q, k, log_decay, scale):
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    if log_decay is None:
        g = torch.zeros(B, T, H, dtype=q.dtype, device=q.device)
    else:
        g = torch.broadcast_to(log_decay, (B, T, H)).to(q.dtype)
    return q * scale, g


def _decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """[B, H, T, T] with exp(A_t - A_j) for j <= t, else 0."""
    A = g.cumsum(1).transpose(1, 2)  # [B, H, T]
    T = A.shape[-1]
    L = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
    return torch.exp((A[..., :, None] - A[..., None, :]).masked_fill(~L, float("-inf")))


def _heads_first(*xs):
    return [x.transpose(1, 2) for x in xs]  # [B, T, H, D] -> [B, H, T, D]


# --------------------------------------------------------------------------- naive forms


def naive_linear_attention(q, k, v, log_decay=None, scale=None, initial_state=None):
    """o = ((Q K^T) ⊙ D) V + exp(A_t) q_t^T h0; returns (o, final state [B, H, K, V])."""
    qs, g = _prep(q, k, log_decay, scale)
    Q, Kk, Vv = _heads_first(qs, k, v)
    D = _decay_matrix(g)
    o = ((Q @ Kk.transpose(-1, -2)) * D) @ Vv
    A = g.cumsum(1).transpose(1, 2)  # [B, H, T]
    w_end = torch.exp(A[..., -1:] - A)  # [B, H, T]
    final = (Kk * w_end[..., None]).transpose(-1, -2) @ Vv
    if initial_state is not None:
        h0 = initial_state.to(q.dtype)
        o = o + torch.exp(A)[..., None] * (Q @ h0)
        final = final + torch.exp(A[..., -1])[..., None, None] * h0
    return o.transpose(1, 2), final


def naive_ccq(q, k, v, log_decay=None, scale=None):
    """o = ((Q~ K^T) ⊙ D) V with Q~ = ((Q K^T) ⊙ D) K, that is
    o_t = sum_{i, j <= t} exp(A_t - A_i) exp(A_t - A_j) (q_t.k_i)(k_i.k_j) v_j."""
    qs, g = _prep(q, k, log_decay, scale)
    Q, Kk, Vv = _heads_first(qs, k, v)
    D = _decay_matrix(g)
    Qt = ((Q @ Kk.transpose(-1, -2)) * D) @ Kk
    return (((Qt @ Kk.transpose(-1, -2)) * D) @ Vv).transpose(1, 2)


def _hla2_matrix(Q, Kk, D, ridge):
    """M[t, j] = sum_{i<=j<=t} exp(A_t - A_i)(q_t.k_i)(k_i.q_j) (+ ridge exp(A_t - A_j) q_t.q_j)."""
    T = Q.shape[-2]
    L = torch.ones(T, T, dtype=torch.bool, device=Q.device).tril()
    W = (Q @ Kk.transpose(-1, -2)) * D  # decayed
    Wu = (Q @ Kk.transpose(-1, -2)) * L  # undecayed
    M = (W @ Wu.transpose(-1, -2)) * L
    if ridge:
        M = M + ridge * (Q @ Q.transpose(-1, -2)) * D
    return M


def naive_hla2(q, k, v, log_decay=None, scale=None, normalize=False, eps=1e-6, ridge=0.0):
    """hla2 = ((W W^T) ⊙ L) V with decay exp(A_t - A_i) on the outer index pair."""
    qs, g = _prep(q, k, log_decay, scale)
    Q, Kk, Vv = _heads_first(qs, k, v)
    M = _hla2_matrix(Q, Kk, _decay_matrix(g), ridge)
    o = M @ Vv
    if normalize:
        o = o / (M.sum(-1, keepdim=True) + eps)
    return o.transpose(1, 2)


def naive_ahla(q, k, v, log_decay=None, scale=None):
    """ahla = ((W W) ⊙ L) V; W is lower triangular, so the mask is implied."""
    qs, g = _prep(q, k, log_decay, scale)
    Q, Kk, Vv = _heads_first(qs, k, v)
    W = (Q @ Kk.transpose(-1, -2)) * _decay_matrix(g)
    return (W @ (W @ Vv)).transpose(1, 2)


def naive_hla3(q, k, v, log_decay=None, scale=None):
    """hla3 = (((W W^T) ⊙ L) W ⊙ L) V: the hla2 matrix applied to W V."""
    qs, g = _prep(q, k, log_decay, scale)
    Q, Kk, Vv = _heads_first(qs, k, v)
    D = _decay_matrix(g)
    W = (Q @ Kk.transpose(-1, -2)) * D
    M = _hla2_matrix(Q, Kk, D, 0.0)
    return (M @ (W @ Vv)).transpose(1, 2)


# --------------------------------------------------------------------------- recurrences


def _steps(qs, k, v, g):
    """Yield (t, q_t, k_t, v_t, gamma_t) with [B, H, D] tensors and gamma [B, H, 1, 1]."""
    for t in range(qs.shape[1]):
        yield t, qs[:, t], k[:, t], v[:, t], torch.exp(g[:, t])[..., None, None]


def _outer(a, b):
    return a[..., :, None] * b[..., None, :]


def recurrent_linear_attention(q, k, v, log_decay=None, scale=None, initial_state=None):
    """h_t = gamma_t h_{t-1} + k_t v_t^T, o_t = q_t^T h_t; returns (o, h_T)."""
    qs, g = _prep(q, k, log_decay, scale)
    B, _T, H, K = q.shape
    h = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for _, qt, kt, vt, gam in _steps(qs, k, v, g):
        h = gam * h + _outer(kt, vt)
        out.append(torch.einsum("bhk,bhkv->bhv", qt, h))
    return torch.stack(out, 1), h


def recurrent_hla2(
    q,
    k,
    v,
    log_decay=None,
    scale=None,
    normalize=False,
    eps=1e-6,
    ridge=0.0,
    initial_state=None,
):
    """S_t = gS + k k^T; k~ = S_t q + ridge q; H_t = gH + k~ v^T; o = q^T H (/ q^T eta).

    k~ is computed as S_t^T q_t, the primitive's convention (o = q^T h), which is
    S_t q_t for every reachable (symmetric) S.

    Returns (o, (S, H, eta or None)).
    """
    qs, g = _prep(q, k, log_decay, scale)
    B, _T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S, Hs, eta = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V), q.new_zeros(B, H, K)
    else:
        S, Hs = initial_state[0].to(q.dtype), initial_state[1].to(q.dtype)
        eta = initial_state[2].to(q.dtype) if normalize else q.new_zeros(B, H, K)
    out = []
    for _, qt, kt, vt, gam in _steps(qs, k, v, g):
        S = gam * S + _outer(kt, kt)
        k_tilde = torch.einsum("bhj,bhji->bhi", qt, S) + ridge * qt
        Hs = gam * Hs + _outer(k_tilde, vt)
        o = torch.einsum("bhk,bhkv->bhv", qt, Hs)
        if normalize:
            eta = gam[..., 0] * eta + k_tilde
            o = o / ((qt * eta).sum(-1, keepdim=True) + eps)
        out.append(o)
    return torch.stack(out, 1), (S, Hs, eta if normalize else None)


def recurrent_ahla(q, k, v, log_decay=None, scale=None, initial_state=None):
    """C_t = gC + k v^T; u_t = C_t^T q_t; H_t = gH + k u^T; o = H_t^T q_t. Returns (o, (C, H))."""
    qs, g = _prep(q, k, log_decay, scale)
    B, _T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        C, Hs = q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
    else:
        C, Hs = (x.to(q.dtype) for x in initial_state)
    out = []
    for _, qt, kt, vt, gam in _steps(qs, k, v, g):
        C = gam * C + _outer(kt, vt)
        u = torch.einsum("bhk,bhkv->bhv", qt, C)
        Hs = gam * Hs + _outer(kt, u)
        out.append(torch.einsum("bhk,bhkv->bhv", qt, Hs))
    return torch.stack(out, 1), (C, Hs)


def recurrent_hla3(q, k, v, log_decay=None, scale=None, initial_state=None):
    """S, C as above; k~ = S_t q_t, u_t = C_t^T q_t, H_t = gH + k~ u^T. Returns (o, (S, C, H))."""
    qs, g = _prep(q, k, log_decay, scale)
    B, _T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S, C, Hs = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
    else:
        S, C, Hs = (x.to(q.dtype) for x in initial_state)
    out = []
    for _, qt, kt, vt, gam in _steps(qs, k, v, g):
        S = gam * S + _outer(kt, kt)
        C = gam * C + _outer(kt, vt)
        k_tilde = torch.einsum("bhj,bhji->bhi", qt, S)
        u = torch.einsum("bhk,bhkv->bhv", qt, C)
        Hs = gam * Hs + _outer(k_tilde, u)
        out.append(torch.einsum("bhk,bhkv->bhv", qt, Hs))
    return torch.stack(out, 1), (S, C, Hs)


def recurrent_ccq(q, k, v, log_decay=None, scale=None, initial_state=None):
    """S_t = gS + k k^T, h_t = gh + k v^T, q~ = S_t q_t, o = h_t^T q~. Returns (o, (S, h))."""
    qs, g = _prep(q, k, log_decay, scale)
    B, _T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S, h = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V)
    else:
        S, h = (x.to(q.dtype) for x in initial_state)
    out = []
    for _, qt, kt, vt, gam in _steps(qs, k, v, g):
        S = gam * S + _outer(kt, kt)
        h = gam * h + _outer(kt, vt)
        q_tilde = torch.einsum("bhj,bhji->bhi", qt, S)
        out.append(torch.einsum("bhk,bhkv->bhv", q_tilde, h))
    return torch.stack(out, 1), (S, h)


# --------------------------------------------------------------------------- the paper's loops


def paper_hla2_masked_loop(q, k, v, scale=None, gamma=1.0, g_step_decay=False):
    """The paper's streaming masked second order: o_t = q_t^T (S_t C_t - G_t).

    S_t = gamma S + k k^T, C_t = gamma C + q v^T, and
    G_t = gamma G + c k k^T C_{t-1} with c = 1 (Sec. 4.3's online update) or
    c = gamma (``g_step_decay``: the one-token step of Sec. 4.2's decayed monoid).
    At gamma = 1 both are the undecayed masked identity.
    """
    qs, _ = _prep(q, k, None, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S, C, G = q.new_zeros(B, H, K, K), q.new_zeros(B, H, K, V), q.new_zeros(B, H, K, V)
    c = gamma if g_step_decay else 1.0
    out = []
    for t in range(T):
        qt, kt, vt = qs[:, t], k[:, t], v[:, t]
        kk = _outer(kt, kt)
        G = gamma * G + c * kk @ C  # uses C_{t-1}
        S = gamma * S + kk
        C = gamma * C + _outer(qt, vt)
        out.append(torch.einsum("bhk,bhkv->bhv", qt, S @ C - G))
    return torch.stack(out, 1)


def paper_hla3_algorithm3(q, k, v, scale=None):
    """What the paper's Algorithm 3 / recurrence (7.5) computes (gamma = 1):

    o_t = q_t^T sum k_a k_a^T q_b q_b^T k_c v_c^T over a, b, c <= t in which the
    largest of (a, b, c) occurs at least twice. Brute force, O(T^4): tiny T only.
    """
    qs, _ = _prep(q, k, None, scale)
    T = q.shape[1]
    idx = torch.arange(T, device=q.device)
    a, b, c = torch.meshgrid(idx, idx, idx, indexing="ij")
    mx = torch.maximum(torch.maximum(a, b), c)
    twice = ((a == mx).long() + (b == mx).long() + (c == mx).long()) >= 2
    out = []
    for t in range(T):
        sel = (twice & (mx <= t)).to(q.dtype)  # [a, b, c]
        # (q_t.k_a)(k_a.q_m)(q_m.k_c) v_c summed over the selected (a, m, c); z = batch.
        qa = torch.einsum("zhk,zahk->zha", qs[:, t], k)
        am = torch.einsum("zahk,zmhk->zham", k, qs)
        mc = torch.einsum("zmhk,zchk->zhmc", qs, k)
        w = torch.einsum("zha,zham,zhmc,amc->zhc", qa, am, mc, sel)
        out.append(torch.einsum("zhc,zchv->zhv", w, v))
    return torch.stack(out, 1)
