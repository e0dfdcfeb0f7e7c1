"""Agreement messages name the differing option and its value on each rank, never
only a hash: ``short_conv differs across ranks: 4 on ranks [0], 2 on ranks [1]``.

On 2 gloo ranks, each scenario makes one rank differ; every rank must raise the same
message, naming the option and both values. Locally (no process group), the row's
texts (the call's name, option names, str values) read back as they were written.
"""

from __future__ import annotations

import pytest
import torch

from hla_sp.ops.validate import check_inputs
from hla_sp.parallel import agreement as A


def _inputs(T: int, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, T, 2, d, generator=gen).to(dtype) for d in (4, 4, 3))


# ---------------------------------------------------------------------- local rows


def _row(op: str, options: dict, bounds: tuple[int, ...] | None = None) -> list[int]:
    q, k, v = _inputs(4)
    x = check_inputs(q, k, v, log_decay=None, scale=None, cu_seqlens=None, sp=None,
                     chunk_size=8)
    return A.metadata_row(x, op, A.named_options(options), bounds, layout="contiguous",
                          method="allgather").tolist()


def test_texts_read_back_from_the_row() -> None:
    table = [_row("hla2", {"precision": "exact", "note": "é" * 3}),
             _row("hla2", {"precision": "fast", "note": "ü"})]
    assert A.disagreements(table) == [
        "precision differs across ranks: 'exact' on ranks [0], 'fast' on ranks [1]",
        "note differs across ranks: 'ééé' on ranks [0], 'ü' on ranks [1]",
    ]
    # A text longer than the row holds: its first 24 bytes, and a hash of all of it.
    long = "a-call-name-longer-than-24-bytes"
    msg = A.disagreements([_row(long + "/1", {}), _row(long + "/2", {})])
    assert len(msg) == 1 and msg[0].startswith(
        "operator differs across ranks: 'a-call-name-longer-than-'... (hash "), msg
    assert msg[0].count("(hash ") == 2
    # Option names: read from the table, or this rank's full names when given.
    name = "an_option_name_longer_than_24"
    table = [_row("op", {name: 1}), _row("op", {name: 2})]
    assert A.disagreements(table, [name]) == [f"{name} differs across ranks: 1 on ranks [0], "
                                              "2 on ranks [1]"]
    assert A.disagreements(table)[0].startswith("an_option_name_longer_th... (hash ")


def test_document_offsets_read_back() -> None:
    cu = (0, 3, 4)
    assert A.disagreements([_row("la", {}, bounds=cu), _row("la", {}, bounds=(0, 4))]) == [
        "cu_seqlens differs across ranks: [0, 3, 4] on ranks [0], [0, 4] on ranks [1]"]
    many = tuple(range(0, 4000, 100))
    msg = A.disagreements([_row("la", {}, bounds=many), _row("la", {}, bounds=None)])
    assert len(msg) == 1 and msg[0].startswith(
        "cu_seqlens differs across ranks: 39 documents, offsets [0, 100, 200, 300, 400, "
        "500, ...] (hash "), msg
    assert msg[0].endswith(") on ranks [0], None on ranks [1]"), msg


def test_rows_have_one_width() -> None:
    """Every rank's row has the same width whatever its texts (one all-gather)."""
    widths = {len(_row(op, opts)) for op, opts in (
        ("hla2", {}), ("x" * 100, {"a": "y" * 100}), ("la", dict.fromkeys("abcdefghij", 1.0)))}
    assert len(widths) == 1, widths
    with pytest.raises(TypeError, match="options: expected str names, got 3"):
        A.named_options({3: 1})
    with pytest.raises(ValueError, match="options: expected at most 10 options, got 11"):
        A.named_options(dict.fromkeys("abcdefghijk", 1))


# ---------------------------------------------------------------- 2 gloo ranks


def _scenarios_task(rank: int, P: int) -> dict[str, str]:
    """Each scenario breaks agreement on rank 1; what each rank raised."""
    import hla_sp
    from hla_sp.nn import HLAHeads
    from hla_sp.parallel import SequenceParallel

    sp = SequenceParallel(check_timeout_s=60.0)
    q, k, v = _inputs(8)
    one = rank == 1
    seen = {}

    def attempt(name, fn):
        try:
            fn()
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = str(e)

    def layer() -> None:
        torch.manual_seed(0)
        m = HLAHeads(2, None, 4, short_conv=2 if one else 4)
        m(q, k, torch.cat([v, v[..., :1]], -1), sp=sp)

    def option(name, value):
        x = check_inputs(q, k, v, log_decay=None, scale=None, cu_seqlens=None, sp=sp,
                         chunk_size=8)
        sp.check_call(x, op="short-conv", options={name: value})

    attempt("short_conv_layer", layer)
    attempt("short_conv", lambda: option("short_conv", 2 if one else 4))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    attempt("precision", lambda: hla_sp.hla2(qb, kb, vb, precision="fast" if one else "exact",
                                             sp=sp))
    attempt("ridge", lambda: hla_sp.hla2(q, k, v, ridge=0.25 if one else 0.0, sp=sp))
    attempt("final", lambda: hla_sp.ahla(q, k, v, output_final_state=one, sp=sp))
    attempt("str_value", lambda: option("mode", "left" if one else "right"))
    attempt("operator", lambda: (hla_sp.hla3 if one else hla_sp.linear_attention)(
        q, k, v, sp=sp))
    attempt("names", lambda: sp.check_call(
        check_inputs(q, k, v, log_decay=None, scale=None, cu_seqlens=None, sp=sp,
                     chunk_size=8),
        op="names", options={"a": 1, **({"b": 2} if one else {})}))
    return seen


# The option's name and its value on each rank, as every rank must read them.
EXPECT = {
    "short_conv": "short_conv differs across ranks: 4 on ranks [0], 2 on ranks [1]",
    "precision": "precision differs across ranks: 'exact' on ranks [0], 'fast' on ranks [1]",
    "ridge": "ridge differs across ranks: 0.0 on ranks [0], 0.25 on ranks [1]",
    "final": "output_final_state differs across ranks: False on ranks [0], True on ranks [1]",
    "str_value": "mode differs across ranks: 'right' on ranks [0], 'left' on ranks [1]",
    "operator": "operator differs across ranks: 'linear' on ranks [0], 'hla3' on ranks [1]",
    "names": "option names differ across ranks: ['a'] on ranks [0], ['a', 'b'] on ranks [1]",
}
# The layer passes its convolution's taps as the option short_conv (the call's name,
# 'short-conv/layer', is the same whatever the taps), so the message names the option.
EXPECT["short_conv_layer"] = EXPECT["short_conv"]


@pytest.mark.timeout(300)
def test_messages_name_the_option_and_each_ranks_value(world) -> None:
    per_rank = world(2).run(_scenarios_task, timeout=240)
    assert per_rank[0] == per_rank[1]  # the same text on every rank
    seen = per_rank[0]
    prefix = "SequenceParallel: the ranks of the group disagree on this call: "
    for name, text in EXPECT.items():
        assert seen[name] == prefix + text, (name, seen[name])
    for name, msg in seen.items():
        assert "hash" not in msg, (name, msg)
