"""HLAttention with ``sp=``: each rank's shard gives its slice of the one-process result.

fp64, so the only difference from one process is the order of sums (tolerance 1e-9).
Covers GQA (the interleaved shared stages plan their own calls), packed documents
crossing ranks, uneven contiguous shards and Megatron's zigzag.
"""

from __future__ import annotations

import pytest
import torch

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


def sp_task(rank: int, world_size: int, op: str, decay: str, layout: str,
            lengths: list[int] | None, packed: bool) -> dict:
    from hla_sp import SequenceParallel
    from hla_sp.parallel import shard

    m = _layer(op, decay)
    x = torch.randn(1 if packed else 2, T, 24, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 9, 23, T]) if packed else None
    w = torch.randn_like(x, generator=torch.Generator().manual_seed(6))
    out: dict = {}
    if rank == 0:  # the one-process reference
        y, st = m(x, cu_seqlens=cu, output_final_state=True)
        (y * w).sum().backward()
        out["ref"] = (y.detach(), [s.detach() for s in st if s is not None],
                      {n: p.grad.clone() for n, p in m.named_parameters()})
        m.zero_grad()
    sp = SequenceParallel(layout=layout)
    kw = {} if lengths is None else {"lengths": lengths}
    xs = shard(x, rank, world_size, layout, **kw)
    ws = shard(w, rank, world_size, layout, **kw)
    y, st = m(xs, cu_seqlens=cu, sp=sp, output_final_state=True)
    (y * ws).sum().backward()
    # An empty shard leaves some grads None: it contributes zero to the sum.
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for n, p in m.named_parameters()}
    for g in grads.values():
        torch.distributed.all_reduce(g)
    out.update(y=y.detach(), state=[s.detach() for s in st if s is not None], grads=grads)
    return out


CASES = [
    ("hla2", "data", "zigzag", None, False),
    ("hla3", "learned", "contiguous", [7, 0, 33], False),
    ("ahla", "fixed", "zigzag", None, True),
    ("linear", "none", "contiguous", [13, 20, 7], True),
    ("hla2", "learned", "contiguous", [T], True),
    ("hla3", "data", "contiguous", [11, 0, 17, 12], True),
    ("ahla", "learned", "zigzag", None, False),
]


@pytest.mark.parametrize(("op", "decay", "layout", "lengths", "packed"), CASES,
                         ids=[f"{c[0]}-{c[2]}-P{len(c[3]) if c[3] else 2}"
                              f"{'-varlen' if c[4] else ''}" for c in CASES])
def test_layer_under_sp_equals_one_process(world, op, decay, layout, lengths, packed):
    from hla_sp.parallel import shard

    P = len(lengths) if lengths is not None else 2
    outs = world(P).run(sp_task, op, decay, layout, lengths, packed)
    y_ref, st_ref, g_ref = outs[0]["ref"]
    kw = {} if lengths is None else {"lengths": lengths}
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["y"], shard(y_ref, r, P, layout, **kw),
                                   rtol=1e-9, atol=1e-9)
        for s, s_ref in zip(o["state"], st_ref):  # the final state is global
            torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)
    for n, g in g_ref.items():
        torch.testing.assert_close(outs[0]["grads"][n], g, rtol=1e-9, atol=1e-9, msg=n)
