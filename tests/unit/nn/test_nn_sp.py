"""HLAttention with ``sp=``: each rank's shard gives its slice of the one-process result.

fp64, so the only difference from one process is the order of sums (tolerance 1e-9).
Covers GQA (the interleaved shared stages plan their own calls), packed documents
crossing ranks, uneven contiguous shards and Megatron's zigzag.
"""

from __future__ import annotations

import pytest
import torch

from hla_sp.config import BUILTIN_OPERATORS

T = 40


def _layer(op: str, decay: str):
    from hla_sp.nn import HLAttention

    torch.manual_seed(11)
    m = HLAttention(24, 4, 6, 2, operator=op, decay=decay, chunk_size=8,
                    normalize=op == "hla2").double()
    with torch.no_grad():  # zero at init: give the data gate and the first-order path values
        for p in (m.heads.decay_weight, m.heads.key_mix, m.heads.value_mix):
            if p is not None:
                torch.nn.init.normal_(p, std=1.0)
    return m


def _flat(state: tuple) -> list[torch.Tensor]:
    """The tensors of a (possibly nested: LayerState(op, conv)) state, in order."""
    out: list[torch.Tensor] = []
    for s in state:
        if isinstance(s, tuple):
            out += _flat(s)
        elif s is not None:
            out.append(s.detach())
    return out


def _carried_state(m, packed: bool) -> tuple:
    """A state to continue from: the final state of one process over a random prefix
    (3 documents when packed, else 2 rows), so its S is a real key moment."""
    g = torch.Generator().manual_seed(8)
    if packed:
        x0, cu0 = torch.randn(1, 15, 24, dtype=torch.float64, generator=g), torch.tensor(
            [0, 5, 9, 15])
    else:
        x0, cu0 = torch.randn(2, 7, 24, dtype=torch.float64, generator=g), None
    with torch.no_grad():
        return m(x0, cu_seqlens=cu0, output_final_state=True)[1]


def sp_task(rank: int, world_size: int, op: str, decay: str, layout: str,
            lengths: list[int] | None, packed: bool, carried: bool) -> dict:
    from hla_sp import SequenceParallel
    from hla_sp.parallel import shard

    m = _layer(op, decay)
    x = torch.randn(1 if packed else 2, T, 24, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 9, 23, T]) if packed else None
    w = torch.randn_like(x, generator=torch.Generator().manual_seed(6))
    st0 = _carried_state(m, packed) if carried else None
    out: dict = {}
    if rank == 0:  # the one-process reference
        y, st = m(x, cu_seqlens=cu, initial_state=st0, output_final_state=True)
        (y * w).sum().backward()
        out["ref"] = (y.detach(), _flat(st),
                      {n: p.grad.clone() for n, p in m.named_parameters()})
        m.zero_grad()
    sp = SequenceParallel(layout=layout)
    kw = {} if lengths is None else {"lengths": lengths}
    xs = shard(x, rank, world_size, layout, **kw)
    ws = shard(w, rank, world_size, layout, **kw)
    y, st = m(xs, cu_seqlens=cu, sp=sp, initial_state=st0, output_final_state=True)
    (y * ws).sum().backward()
    # An empty shard leaves some grads None: it contributes zero to the sum.
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for n, p in m.named_parameters()}
    for g in grads.values():
        torch.distributed.all_reduce(g)
    out.update(y=y.detach(), state=_flat(st), grads=grads)
    return out


# (operator, decay, layout, local lengths or None (even), packed documents, carried state)
CASES = [
    ("hla2", "data", "zigzag", None, False, False),
    ("hla3", "learned", "contiguous", [7, 0, 33], False, True),
    ("ahla", "fixed", "zigzag", None, True, True),
    ("linear", "none", "contiguous", [13, 20, 7], True, False),
    ("hla2", "learned", "contiguous", [T], True, True),
    ("hla3", "data", "contiguous", [11, 0, 17, 12], True, True),
    ("ahla", "learned", "zigzag", None, False, False),
    ("hla2", "fixed", "contiguous", [2, 1, 0, 37], False, True),  # shards shorter than W-1
]
# Every other built-in operator of the table, in one case with documents and a state.
CASES += [(op, "learned", "zigzag", None, True, True) for op in BUILTIN_OPERATORS
          if op not in {c[0] for c in CASES}]


@pytest.mark.parametrize(("op", "decay", "layout", "lengths", "packed", "carried"), CASES,
                         ids=[f"{c[0]}-{c[2]}-P{len(c[3]) if c[3] else 2}"
                              f"{'-varlen' if c[4] else ''}{'-carried' if c[5] else ''}"
                              for c in CASES])
def test_layer_under_sp_equals_one_process(world, op, decay, layout, lengths, packed, carried):
    from hla_sp.parallel import shard

    P = len(lengths) if lengths is not None else 2
    outs = world(P).run(sp_task, op, decay, layout, lengths, packed, carried)
    y_ref, st_ref, g_ref = outs[0]["ref"]
    kw = {} if lengths is None else {"lengths": lengths}
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["y"], shard(y_ref, r, P, layout, **kw),
                                   rtol=1e-9, atol=1e-9)
        for s, s_ref in zip(o["state"], st_ref):  # the final state is global
            torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)
    for n, g in g_ref.items():
        torch.testing.assert_close(outs[0]["grads"][n], g, rtol=1e-9, atol=1e-9, msg=n)
