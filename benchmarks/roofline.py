"""Roofline estimates per kernel of the chunk_h / chunk_o design (issue 50): a model, not
a measurement.

The primitive is five kernels, as fla's ``chunk_simple_gla`` (fla/ops/common/chunk_h.py,
chunk_o.py): ``fwd_h`` (the state pass over the chunks, the state held on chip, stored
once per chunk), ``fwd_o`` (the output from q, k, v and the chunk's state), and in
backward ``fwd_h`` again (states recomputed, fp32), ``bwd_dh`` (the reverse pass),
``bwd_dv`` and ``bwd_dqk`` (dq, dk and the decay's gradient). hla2 is two passes of
the primitive: S = states(k, k), k~ = the read-out of S by q (the first pass's
``fwd_o``, stored in bf16), H = states(k~, v), o = output(q, k~, v, H); its backward is
the primitive's backward twice, and autograd's sum of the two dq and decay gradients.

Counts, per head, bf16 operands (E = 2 bytes), fp32 decays, chunk BT = 64, N = T / BT:
- FLOPs: 2 per multiply-add of every dot the kernel issues, score tiles recomputed per
  value block included; elementwise work is not counted;
- bytes: every tile each program loads or stores (re-reads across K or V blocks
  included; caches assumed to catch nothing), states as the design stores them (bf16
  in the forward, fp32 in the backward);
- programs: the launch grid; a state pass has only B H (K / BK) (V / BV) of them,
  serial over the chunks.

Time per kernel: the roofline max(FLOPs / peak, bytes / bandwidth), then that time
over the fraction of the 132 SMs the grid can occupy, min(1, programs / 132) (an SM
is assumed to reach its share of the bandwidth and the tensor peak, no more: for a
state pass with fewer programs than SMs this is pessimistic). Tiles are chosen by the
model's time: BK = BV in {32, 64, 128} for the state passes, {64, 128} for the others.
Launch latency (about 3 us a kernel) is left out. Peaks: H200 989 dense bf16 TFLOP/s
and 4.8 TB/s; H100 SXM 989 and 3.35 TB/s.

    python benchmarks/roofline.py          (prints the tables of docs/benchmarks.md)
"""

from __future__ import annotations

from dataclasses import dataclass

GPUS = {"H200": (989e12, 4.8e12), "H100 SXM": (989e12, 3.35e12)}  # bf16 FLOP/s, B/s
SMS = 132
BT, E, F = 64, 2, 4  # chunk; bytes of bf16 and fp32
SHAPES = ((1, 8192, 16, 128), (1, 32768, 16, 128), (1, 8192, 96, 128))  # B, T, H, K = V
STATE_TILES, CHUNK_TILES = (32, 64, 128), (64, 128)
# Measured on one H200 (benchmarks/results/gpu/bench_gpu_h200.json), fwd+bwd ms: the
# reference for the hla2 / SDPA targets until the next lease measures both in one run.
SDPA_MEASURED_MS = {(1, 8192, 16): 3.43, (1, 32768, 16): 46.84}
FLA_ANCHOR_MS = 3.37  # fla's chunk_linear_attn fwd+bwd, B 1, T 8192, H 96, D 128, H100


@dataclass(frozen=True)
class Kernel:
    """One launch: its name, tile, FLOPs, bytes and grid size (all heads)."""

    name: str
    tile: int
    flops: float
    nbytes: float
    programs: int

    def seconds(self, peak: float, bw: float) -> tuple[float, float, str]:
        """(roofline seconds, seconds with the grid's occupancy, the binding limit)."""
        tc, tm = self.flops / peak, self.nbytes / bw
        roof = max(tc, tm)
        occ = min(1.0, self.programs / SMS)
        limit = "compute" if tc >= tm else "memory"
        if occ < 1:
            limit += f", {self.programs} programs"
        return roof, roof / occ, limit


def state_pass(name: str, B: int, T: int, H: int, K: int, V: int, t: int, state_bytes: int,
               ) -> Kernel:
    """fwd_h (reads k, v) or bwd_dh (reads q, do): per [t, t] block of the state, the
    chunk's two operands' slices, the decays, and the state stored once per chunk."""
    N, NK, NV = T // BT, K // t, V // t
    flops = 2 * T * K * V
    nbytes = T * K * E * NV + T * V * E * NK + T * F * NK * NV + N * K * V * state_bytes
    return Kernel(name, t, B * H * flops, B * H * nbytes, B * H * NK * NV)


def fwd_o(B: int, T: int, H: int, K: int, V: int, t: int) -> Kernel:
    """o = q h + (q k^T masked) v per chunk and V block; scores recomputed per V block."""
    N, NV = T // BT, V // t
    flops = 2 * T * K * V + (2 * BT * K) * T * NV + 2 * BT * V * T
    nbytes = 2 * T * K * E * NV + T * V * E + N * K * V * E + T * F * NV + T * V * E
    return Kernel("fwd_o", t, B * H * flops, B * H * nbytes, B * H * N * NV)


def bwd_dv(B: int, T: int, H: int, K: int, V: int, t: int) -> Kernel:
    """dv = (k q^T masked) do + k dh per chunk and V block (the scores recomputed)."""
    N, NV = T // BT, V // t
    flops = (2 * BT * K) * T * NV + 2 * BT * V * T + 2 * T * K * V
    nbytes = 2 * T * K * E * NV + T * V * E + N * K * V * F + T * F * NV + T * V * E
    return Kernel("bwd_dv", t, B * H * flops, B * H * nbytes, B * H * N * NV)


def bwd_dqk(B: int, T: int, H: int, K: int, V: int, t: int) -> Kernel:
    """dq = do h^T + dA k, dk = v dh^T + dA^T q, dA = do v^T per chunk and K block; the
    decay's gradient from h . dh and a chunk-local cumsum in the epilogue."""
    N, NK = T // BT, K // t
    flops = 4 * T * K * V + 4 * BT * K * T + (2 * BT * V) * T * NK
    nbytes = (2 * T * V * E * NK + 2 * T * K * E + 2 * N * K * V * F + T * F * NK
              + 2 * T * K * E + T * F * NK)
    return Kernel("bwd_dqk", t, B * H * flops, B * H * nbytes, B * H * N * NK)


def best(make, tiles: tuple[int, ...], dims: tuple[int, ...], peak: float, bw: float,
         ) -> Kernel:
    """The tile of ``tiles`` (dividing every dim of ``dims``) with the least model time."""
    ks = [make(t) for t in tiles if all(d % t == 0 for d in dims)]
    return min(ks, key=lambda k: k.seconds(peak, bw)[1])


def primitive(B: int, T: int, H: int, K: int, V: int, gpu: str, bwd: bool) -> list[Kernel]:
    """The kernels of one primitive call (value width V), forward or backward."""
    peak, bw = GPUS[gpu]
    args = (B, T, H, K, V)

    def h(name: str, sb: int) -> Kernel:
        return best(lambda t: state_pass(name, *args, t, sb), STATE_TILES, (K, V), peak, bw)

    if not bwd:
        return [h("fwd_h", E), best(lambda t: fwd_o(*args, t), CHUNK_TILES, (V,), peak, bw)]
    return [h("fwd_h (recompute, fp32)", F), h("bwd_dh", F),
            best(lambda t: bwd_dv(*args, t), CHUNK_TILES, (V,), peak, bw),
            best(lambda t: bwd_dqk(*args, t), CHUNK_TILES, (K,), peak, bw)]


def hla2(B: int, T: int, H: int, K: int, gpu: str, bwd: bool) -> list[Kernel]:
    """Two passes of the primitive (values k, then values v), forward or backward; the
    backward adds autograd's sums of the two passes' dq (bf16) and decay gradient (fp32),
    q and the decay being inputs of both: read two, write one, elementwise."""
    ks = primitive(B, T, H, K, K, gpu, bwd) + primitive(B, T, H, K, K, gpu, bwd)
    if bwd:
        ks.append(Kernel("dq, dg sums", 0, 0.0, B * H * 3 * T * (K * E + F), B * H * T // BT))
    return ks


def total_ms(ks: list[Kernel], gpu: str, occupancy: bool = True) -> float:
    return 1e3 * sum(k.seconds(*GPUS[gpu])[1 if occupancy else 0] for k in ks)


def kernel_table(B: int, T: int, H: int, K: int, gpu: str = "H200") -> list[str]:
    out = [f"| kernel (primitive, B {B} T {T // 1024}k H {H}, {gpu}) | tile | programs | "
           "GFLOP | MB | roofline (us) | with occupancy (us) | limit |",
           "|---|---|---|---|---|---|---|---|"]
    for k in primitive(B, T, H, K, K, gpu, False) + primitive(B, T, H, K, K, gpu, True):
        roof, occ, limit = k.seconds(*GPUS[gpu])
        out.append(f"| {k.name} | {k.tile} | {k.programs:,} | {k.flops / 1e9:.1f} | "
                   f"{k.nbytes / 1e6:.1f} | {roof * 1e6:.1f} | {occ * 1e6:.1f} | {limit} |")
    return out


def totals_table() -> list[str]:
    out = ["| shape | GPU | primitive fwd (ms) | primitive fwd+bwd (ms) | hla2 fwd+bwd (ms) "
           "| hla2 / primitive | SDPA flash, measured (ms) | hla2 / SDPA |",
           "|---|---|---|---|---|---|---|---|"]
    for B, T, H, K in SHAPES:
        for gpu in GPUS:
            fwd = total_ms(primitive(B, T, H, K, K, gpu, False), gpu)
            la = fwd + total_ms(primitive(B, T, H, K, K, gpu, True), gpu)
            h2 = total_ms(hla2(B, T, H, K, gpu, False) + hla2(B, T, H, K, gpu, True), gpu)
            sdpa = SDPA_MEASURED_MS.get((B, T, H)) if gpu == "H200" else None
            out.append(f"| B {B} T {T // 1024}k H {H} | {gpu} | {fwd:.3f} | {la:.3f} | "
                       f"{h2:.3f} | {h2 / la:.2f} | {sdpa if sdpa else 'n/a'} | "
                       f"{f'{h2 / sdpa:.3f}' if sdpa else 'n/a'} |")
    return out


def main() -> None:
    print("\n".join(totals_table()))
    for B, T, H, K in SHAPES:
        print()
        print("\n".join(kernel_table(B, T, H, K)))
    anchor = primitive(1, 8192, 96, 128, 128, "H100 SXM", False) \
        + primitive(1, 8192, 96, 128, 128, "H100 SXM", True)
    print(f"\nfla's anchor (B 1, T 8192, H 96, D 128, H100 SXM): this model "
          f"{total_ms(anchor, 'H100 SXM'):.2f} ms (roofline alone "
          f"{total_ms(anchor, 'H100 SXM', occupancy=False):.2f} ms) against fla's published "
          f"{FLA_ANCHOR_MS} ms")


if __name__ == "__main__":
    main()
