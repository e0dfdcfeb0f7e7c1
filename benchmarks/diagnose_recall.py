"""Why the pure higher-order layers stay at chance on MQAR, in numbers.

Measured on the first layer of the recall model (``bench_recall.RecallLM``) at
initialisation, on one MQAR batch (T = 64, 4 pairs), for the pure hla2 layer (no
first-order path, no convolution: the layer's default before the recall study), the
linear layer and today's hla2 default:

1. k~_t = S_t q_t along T: its norm against the key's (1 after the qk-norm);
2. the key moment S_T: the share of its trace that the filler token brings, the share
   of its top eigenvalue, and its effective rank;
3. the outputs before the per-head RMSNorm: the spread of their norms over positions
   (p95 / p5: the norm's gradient scales as 1 / |o_t|), and the mean cosine between the
   outputs of two query positions of one sequence and head (1: every position says the
   same thing, and the norm leaves only that common direction);
4. gradients at initialisation: the norms of the q/k/v projection gradients of both
   layers, and of the first-order weights;
5. fp32 against fp64: the relative error of the layer output, and two 20-step training
   runs at 1 and at 2 threads (their largest loss difference and mean gradient norms).

    python benchmarks/diagnose_recall.py     # -> runs/bench_recall/diagnosis.json (~2 min)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recall import MIXERS, ROOT, RecallLM, make_optimizer, mqar_batch

from hla_sp import linear_attention

VARIANTS = ("hla2-pure-noconv", "linear", "hla2")


def _first_layer_qkv(model: RecallLM, tokens: torch.Tensor):
    """q (scaled), k, v [B, T, H, K] and the log-decay of the first mixer, as it sees them."""
    block = model.blocks[0]
    layer = block["mix"]
    h = block["n1"](model.emb(tokens))
    B, T, _ = h.shape
    heads = layer.heads
    q = layer.q_proj(h).view(B, T, heads.num_heads, heads.head_dim)
    k = layer.k_proj(h).view(B, T, heads.num_kv_heads, heads.head_dim)
    v = layer.v_proj(h).view(B, T, heads.num_kv_heads, heads.head_dim)
    if heads.conv is not None:
        q, k, v, _ = heads._convolve(q, k, v, None, None, None, False)
    g = heads.log_decay(k)
    if heads.qk_norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return q * heads.head_dim ** -0.5, k, v, g


@torch.no_grad()
def moments(mixer: str, tokens: torch.Tensor) -> dict[str, Any]:
    """Items 1-3 for the first layer of a fresh model."""
    torch.manual_seed(0)
    model = RecallLM(mixer, tokens.shape[1]).double()
    q, k, v, g = _first_layer_qkv(model, tokens)
    kt, S = linear_attention(q, k, k, log_decay=g, scale=1.0, output_final_state=True)
    out: dict[str, Any] = {}
    for t in (7, 15, 31, 63):
        out[f"k_tilde_norm_t{t + 1}"] = kt[:, t].norm(dim=-1).mean().item()
    # S_T's spectrum, per sequence and head, and the filler's share of its trace.
    ev = torch.linalg.eigvalsh(S)  # [B, H, K], ascending
    out["S_top_eig_share"] = (ev[..., -1] / ev.sum(-1)).mean().item()
    # S has rank <= the number of distinct tokens (< K), so its condition number is
    # infinite; its effective rank exp(entropy of the normalised spectrum) says more.
    p = ev.clamp_min(0) / ev.clamp_min(0).sum(-1, keepdim=True)
    out["S_effective_rank"] = torch.exp(-(p * p.clamp_min(1e-300).log()).sum(-1)).mean().item()
    # The filler's share of trace(S) (decay is close to 1 over 64 tokens at init).
    filler = (tokens == 0).double()[..., None]  # [B, T, 1]
    kk = k.pow(2).sum(-1)  # |k|^2 = 1 per token and head
    out["S_trace_share_filler"] = ((kk * filler).sum(1) / kk.sum(1)).mean().item()
    # Outputs before the norm: pairwise cosine over query positions.
    heads = model.blocks[0]["mix"].heads
    if mixer.startswith("linear"):
        o, _ = linear_attention(q, k, v, log_decay=g, scale=1.0)
    else:
        from hla_sp.ops import run_operator

        mix = None if heads.key_mix is None else torch.full_like(heads.key_mix, 1.0)
        o, _ = run_operator("hla2", q, k, v, log_decay=g, scale=1.0, key_mix=mix)
    # The RMSNorm divides by |o_t|: a wide spread of |o_t| over t means large, uneven
    # gradients through it where |o_t| is small.
    mag = o[:, 8:].norm(dim=-1)  # [B, T', H]
    q95, q05 = torch.quantile(mag.flatten(), 0.95), torch.quantile(mag.flatten(), 0.05)
    out["output_norm_p95_over_p5"] = (q95 / q05).item()
    on = F.normalize(o[:, 8:], dim=-1)  # past the pairs
    cos = torch.einsum("bthd,bshd->bhts", on, on)
    n = cos.shape[-1]
    out["output_mean_pairwise_cosine"] = ((cos.sum((-1, -2)) - n) / (n * (n - 1))).mean().item()
    return out


def gradients(mixer: str, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Item 4: gradient norms at initialisation."""
    torch.manual_seed(0)
    model = RecallLM(mixer, tokens.shape[1])
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    out = {}
    for i, b in enumerate(model.blocks):
        layer = b["mix"]
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"layer{i}.{name}"] = getattr(layer, name).weight.grad.norm().item()
        if layer.heads.key_mix is not None:
            out[f"layer{i}.key_mix"] = layer.heads.key_mix.grad.norm().item()
    return out


@torch.no_grad()
def fp32_error(mixer: str, tokens: torch.Tensor) -> float:
    """Item 5a: max relative error of the model's logits, fp32 against fp64."""
    torch.manual_seed(0)
    model = RecallLM(mixer, tokens.shape[1])
    lo32 = model(tokens)
    lo64 = model.double()(tokens)
    return ((lo32.double() - lo64).abs().max() / lo64.abs().max()).item()


def _train_task(mixer: str, threads: int, steps: int) -> dict[str, list[float]]:
    """20 steps of the benchmark's training, returning losses and gradient norms."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = RecallLM(mixer, 64)
    opt = make_optimizer(model, mixer, 3e-3)
    losses, norms = [], []
    for _ in range(steps):
        x, y = mqar_batch(64, 64, 4, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(loss.item())
    return {"loss": losses, "grad_norm": norms}


def thread_divergence(mixer: str, steps: int = 20) -> dict[str, float]:
    """Item 5b: the same run at 1 and 2 threads, each in a fresh process."""
    runs = []
    for threads in (1, 2):
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from diagnose_recall import _train_task; "
                f"print(json.dumps(_train_task({mixer!r}, {threads}, {steps})))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    a, b = runs
    return {"max_loss_diff": max(abs(x - y) for x, y in zip(a["loss"], b["loss"])),
            "grad_norm_mean_1thread": sum(a["grad_norm"]) / steps,
            "grad_norm_mean_2threads": sum(b["grad_norm"]) / steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_recall")
    ap.add_argument("--mixers", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    mixers = [m for m in a.mixers.split(",") if m]
    for m in mixers:
        if m not in MIXERS or MIXERS[m].get("softmax"):
            raise SystemExit(f"--mixers: expected layer mixers of bench_recall, got {m!r}")
    tokens, labels = mqar_batch(64, 64, 4, torch.Generator().manual_seed(0))
    res: dict[str, Any] = {}
    for m in mixers:
        res[m] = {"moments": moments(m, tokens), "gradients": gradients(m, tokens, labels),
                  "fp32_rel_error": fp32_error(m, tokens), "threads": thread_divergence(m)}
        print(m, json.dumps(res[m], indent=1), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "diagnosis.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out / 'diagnosis.json'}")


if __name__ == "__main__":
    main()
