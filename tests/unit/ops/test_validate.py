"""Bad input is rejected before any work, with the argument, expectation and value."""

from __future__ import annotations

import pytest
import torch

import hla_sp

OPERATORS = {
    "linear": hla_sp.linear_attention,
    "hla2": hla_sp.hla2,
    "ahla": hla_sp.ahla,
    "hla3": hla_sp.hla3,
}


def _qkv(B=1, T=8, H=2, K=4, V=3, dtype=torch.float32):
    return torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype), torch.randn(
        B, T, H, V, dtype=dtype
    )


def _cases():
    q, k, v = _qkv()
    q2, k2, v2 = _qkv(B=2)
    yield "q_rank", (q[0], k, v), {}, ValueError, ["q", "4-D", "(8, 2, 4)"]
    yield "k_shape", (q, k[:, :5], v), {}, ValueError, ["k", "(1, 8, 2, 4)", "(1, 5, 2, 4)"]
    yield "v_heads", (q, k, v[:, :, :1]), {}, ValueError, ["v", "(1, 8, 2)", "(1, 8, 1)"]
    yield "k_dtype", (q, k.double(), v), {}, TypeError, ["k", "torch.float32", "torch.float64"]
    yield "v_int", (q, k, v.long()), {}, TypeError, ["v", "floating", "torch.int64"]
    yield "q_list", ([1.0], k, v), {}, TypeError, ["q", "torch.Tensor", "list"]
    yield "T0", (q[:, :0], k[:, :0], v[:, :0]), {}, ValueError, ["q", "T >= 1", "T = 0"]
    yield (
        "decay_positive",
        (q, k, v),
        {"log_decay": torch.tensor([-0.1, 0.2])},
        ValueError,
        ["log_decay", "<= 0", "0.2"],
    )
    yield (
        "decay_nan",
        (q, k, v),
        {"log_decay": torch.tensor([-0.1, float("nan")])},
        ValueError,
        ["log_decay", "<= 0", "nan"],
    )
    yield (
        "decay_shape",
        (q, k, v),
        {"log_decay": torch.zeros(3)},
        ValueError,
        ["log_decay", "[1, 8, 2]", "(3,)"],
    )
    cu = torch.tensor([0, 3, 8])
    yield "cu_B2", (q2, k2, v2), {"cu_seqlens": cu}, ValueError, ["q", "B == 1", "B = 2"]
    yield (
        "cu_start",
        (q, k, v),
        {"cu_seqlens": torch.tensor([1, 3, 8])},
        ValueError,
        ["cu_seqlens", "cu_seqlens[0] == 0", "= 1"],
    )
    yield (
        "cu_end",
        (q, k, v),
        {"cu_seqlens": torch.tensor([0, 3, 7])},
        ValueError,
        ["cu_seqlens", "T = 8", "= 7"],
    )
    yield (
        "cu_order",
        (q, k, v),
        {"cu_seqlens": torch.tensor([0, 5, 5, 8])},
        ValueError,
        ["cu_seqlens", "strictly increasing", "cu_seqlens[1] = 5"],
    )
    yield (
        "cu_float",
        (q, k, v),
        {"cu_seqlens": torch.tensor([0.0, 8.0])},
        TypeError,
        ["cu_seqlens", "int32 or int64", "float32"],
    )
    yield "chunk", (q, k, v), {"chunk_size": 48}, ValueError, ["chunk_size", "power of two", "48"]
    yield "scale", (q, k, v), {"scale": "big"}, TypeError, ["scale", "float", "str"]


CASES = list(_cases())


@pytest.mark.parametrize("name", list(OPERATORS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_argument_expected_and_received(case, name):
    _, args, kwargs, exc, words = case
    with pytest.raises(exc) as info:
        OPERATORS[name](*args, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_bad_input_is_rejected_before_work(monkeypatch):
    from hla_sp.ops import primitive

    calls = []
    monkeypatch.setattr(primitive, "local_primitive", lambda *a, **k: calls.append(1))
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        hla_sp.hla2(q, k, v, log_decay=torch.tensor([0.5, 0.0]))
    assert calls == []


@pytest.mark.parametrize(
    "op, state, words",
    [
        ("linear", torch.zeros(1, 2, 4, 4), ["initial_state", "[1, 2, 4, 3]", "[1, 2, 4, 4]"]),
        ("hla2", (torch.zeros(1, 2, 4, 4),), ["initial_state", "S, H"]),
        (
            "hla2",
            (torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 3, 3)),
            ["initial_state.H", "[1, 2, 4, 3]", "[1, 2, 3, 3]"],
        ),
        ("ahla", torch.zeros(1, 2, 4, 3), ["initial_state", "tuple", "Tensor"]),
        (
            "hla3",
            (torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 3), torch.zeros(2, 2, 4, 3)),
            ["initial_state.H", "[1, 2, 4, 3]", "[2, 2, 4, 3]"],
        ),
    ],
    ids=["linear", "hla2_missing", "hla2_shape", "ahla_type", "hla3_batch"],
)
def test_bad_initial_state(op, state, words):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError)) as info:
        OPERATORS[op](q, k, v, initial_state=state)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_hla2_state_eta_must_match_normalize():
    q, k, v = _qkv()
    S, H = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 3)
    with pytest.raises(ValueError, match="eta"):
        hla_sp.hla2(q, k, v, normalize=True, initial_state=(S, H))
    with pytest.raises(ValueError, match="eta"):
        hla_sp.hla2(q, k, v, initial_state=(S, H, torch.zeros(1, 2, 4)))


def test_varlen_initial_state_has_one_row_per_document():
    q, k, v = _qkv()
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match=r"\[2, 2, 4, 3\]"):
        hla_sp.linear_attention(q, k, v, cu_seqlens=cu, initial_state=torch.zeros(1, 2, 4, 3))


def test_backend_variable(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("HLA_SP_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="HLA_SP_BACKEND"):
        hla_sp.linear_attention(q, k, v)
    monkeypatch.setenv("HLA_SP_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton"):
        hla_sp.linear_attention(q, k, v)
    monkeypatch.setenv("HLA_SP_BACKEND", "torch")
    o, _ = hla_sp.linear_attention(q, k, v)
    assert o.shape == (1, 8, 2, 3)


@pytest.mark.parametrize("name", list(OPERATORS))
@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"scale": float("nan")}, ValueError, ["scale", "finite", "nan"]),
        ({"scale": float("inf")}, ValueError, ["scale", "finite", "inf"]),
        ({"output_final_state": "no"}, TypeError, ["output_final_state", "bool", "str"]),
        ({"output_final_state": 1}, TypeError, ["output_final_state", "bool", "int"]),
    ],
    ids=["scale_nan", "scale_inf", "final_str", "final_int"],
)
def test_options_checked_by_name(name, kwargs, exc, words):
    q, k, v = _qkv()
    with pytest.raises(exc) as info:
        OPERATORS[name](q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ridge": float("nan")}, ["ridge", "finite float >= 0", "nan"]),
        ({"ridge": float("inf")}, ["ridge", "finite float >= 0", "inf"]),
        ({"eps": float("inf")}, ["eps", "finite float >= 0", "inf"]),
        ({"eps": float("nan"), "normalize": True}, ["eps", "finite float >= 0", "nan"]),
    ],
    ids=["ridge_nan", "ridge_inf", "eps_inf", "eps_nan"],
)
def test_hla2_float_options_finite(kwargs, words):
    q, k, v = _qkv()
    with pytest.raises(ValueError) as info:
        hla_sp.hla2(q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_too_long_state_tuple_is_a_clear_error():
    """(S0, H0, None, None) used to raise an IndexError while building its own message."""
    q, k, v = _qkv()
    S, H = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 3)
    with pytest.raises(ValueError) as info:
        hla_sp.hla2(q, k, v, initial_state=(S, H, None, None))
    msg = str(info.value)
    for w in ["initial_state", "at most 3 fields", "S, H, eta", "tuple of 4"]:
        assert w in msg, (w, msg)


def test_v_without_features_is_reported_against_v():
    q, k, v = _qkv(V=0)
    for fn in OPERATORS.values():
        with pytest.raises(ValueError) as info:
            fn(q, k, v)
        assert str(info.value).startswith("v: expected a non-zero value dim V"), str(info.value)


def test_chunk_size_capped_at_sequence_length(monkeypatch):
    """A chunk far longer than T is cut to the least power of two >= T, same result
    (chunk 2^20 at T=16 used to allocate 1 TiB)."""
    import importlib

    la = importlib.import_module("hla_sp.ops.primitive")
    seen: list[int] = []
    real = la.local_primitive

    def spy(*a, **kw):
        seen.append(kw["chunk_size"])
        return real(*a, **kw)

    monkeypatch.setattr(la, "local_primitive", spy)
    q, k, v = _qkv(T=13, dtype=torch.float64)
    g = -torch.rand(1, 13, 2, dtype=torch.float64)
    o_big, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=2**20)
    o_16, _ = hla_sp.hla2(q, k, v, log_decay=g, chunk_size=16)
    assert seen and set(seen) == {16}, seen
    torch.testing.assert_close(o_big, o_16, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["hla2", "hla3"])
def test_non_symmetric_key_moment_refused(op):
    """S is symmetric by construction and the operators read S q = S^T q only then."""
    q, k, v = _qkv()
    S = torch.randn(1, 2, 4, 4)
    S = S + S.transpose(-1, -2)
    rest = [torch.zeros(1, 2, 4, 3)] * (1 if op == "hla2" else 2)
    OPERATORS[op](q, k, v, initial_state=(S, *rest))  # symmetric: accepted
    S_bad = S.clone()
    S_bad[0, 1, 0, 2] += 1.0
    with pytest.raises(ValueError) as info:
        OPERATORS[op](q, k, v, initial_state=(S_bad, *rest))
    msg = str(info.value)
    for w in ["initial_state.S", "symmetric", "max |S - S^T| = 1", "[n, h] = [0, 1]"]:
        assert w in msg, (w, msg)


def test_returned_state_passes_the_symmetry_check():
    """A final S from a long fp32 call (summed in chunks) is accepted back."""
    q, k, v = _qkv(T=300, K=16, V=8)
    g = -0.01 * torch.rand(1, 300, 2)
    _, st = hla_sp.hla2(q, k, v, log_decay=g, output_final_state=True, chunk_size=16)
    hla_sp.hla2(q, k, v, log_decay=g, initial_state=st, chunk_size=16)
