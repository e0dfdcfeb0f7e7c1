"""--data synthetic-recall across context-parallel ranks: the pairs sit on rank 0, the
queries on rank CP-1, and the held-out recall accuracy is reported and equals CP=1's."""

from __future__ import annotations

import json
import math

import pytest
from hla_sp.launch.data.datasets import RecallSamples
from hla_sp.launch.distributed.local import run_local

RECALL = [
    "--data", "synthetic-recall", "--recall-pairs", "4", "--seq-length", "64",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
    "--micro-batch-size", "4", "--train-iters", "3", "--lr", "3e-3", "--seed", "3",
    "--eval-interval", "1", "--eval-iters", "2", "--log-interval", "1",
]  # fmt: skip


def test_recall_accuracy_cp4_equals_cp1(tmp_path) -> None:
    runs = {}
    for cp in (1, 4):
        r = run_local([*RECALL, "--context-parallel-size", str(cp)], cp,
                      str(tmp_path / f"cp{cp}.jsonl"), timeout=600)
        assert r.returncode == 0, r.output[-4000:]
        assert "recall acc" in r.output, r.output[-2000:]
        runs[cp] = r.records
    # 2 eval batches x 4 samples x 4 queries: one flipped argmax moves the accuracy 1/32.
    labelled = 2 * 4 * 4
    for a, b in zip(runs[1], runs[4]):
        # fp32 sums in another order (zigzag quarters, the scan across ranks): about
        # 1e-6 relative; a wrong carry across ranks moves these losses in the first digit.
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-5), (a, b)
        assert math.isclose(a["val_loss"], b["val_loss"], rel_tol=2e-5), (a, b)
        assert 0.0 <= a["val_recall_acc"] <= 1.0
        assert abs(a["val_recall_acc"] - b["val_recall_acc"]) <= 1 / labelled + 1e-12


def test_constant_filler_keeps_the_pairs_and_queries() -> None:
    T, n = 64, 4
    rand, const = RecallSamples(T, n, 5), RecallSamples(T, n, 5, filler="constant")
    for i in range(3):
        a, b = rand[i], const[i]
        assert bool(a.loss_mask.eq(b.loss_mask).all())
        marked = b.loss_mask.bool()
        assert bool(a.labels[marked].eq(b.labels[marked]).all())  # the same answers
        # pairs (0 .. 2n-1) and queries (T/2 .. T/2+2n-1) as inputs; filler elsewhere
        keep = list(range(2 * n)) + list(range(T // 2, T // 2 + 2 * n))
        assert bool(a.tokens[keep].eq(b.tokens[keep]).all())
        rest = [t for t in range(T) if t not in keep]
        assert len(set(b.tokens[rest].tolist())) == 1
        assert len(set(a.tokens[rest].tolist())) > 1
    with pytest.raises(ValueError, match=r"--recall-filler: expected one of .*got 'zeros'"):
        RecallSamples(T, n, 5, filler="zeros")


def test_skip_train_evaluates_a_checkpoint_at_another_cp_size(tmp_path) -> None:
    """--skip-train --load: the weights a CP=2 run saved give its last held-out figures
    when evaluated again at CP=2 (the same sums) and at CP=1 (another summation order),
    and the evaluation is logged as an event, not as an iteration record."""
    save = str(tmp_path / "ckpt")
    trained = run_local([*RECALL, "--context-parallel-size", "2", "--save", save], 2,
                        str(tmp_path / "train.jsonl"), timeout=600)
    assert trained.returncode == 0, trained.output[-4000:]
    last = trained.records[-1]
    for cp in (2, 1):
        jsonl = tmp_path / f"eval_cp{cp}.jsonl"
        r = run_local([*RECALL, "--context-parallel-size", str(cp), "--load", save,
                       "--skip-train"], cp, str(jsonl), timeout=600)
        assert r.returncode == 0, r.output[-4000:]
        assert "evaluated the checkpoint at iteration 3" in r.output, r.output[-2000:]
        assert r.records == []  # no iteration was trained, none was logged
        events = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [e["event"] for e in events] == ["evaluation"]
        ev = events[0]
        assert (ev["iteration"], ev["cp"]) == (3, cp)
        # CP=2 repeats the training run's sums exactly; CP=1 sums the same fp32 terms in
        # another order (about 1e-6 relative, as in the test above)
        assert math.isclose(ev["val_loss"], last["val_loss"], rel_tol=0 if cp == 2 else 2e-5)
        assert abs(ev["val_recall_acc"] - last["val_recall_acc"]) <= (
            0 if cp == 2 else 1 / (2 * 4 * 4) + 1e-12)


@pytest.mark.parametrize(("flags", "message"), [
    (["--skip-train"], r"--skip-train: expected --load naming a directory with a "
                       r"checkpoint to evaluate, got no --load"),
    (["--skip-train", "--load", "EMPTY"], r"got --load .*EMPTY, which holds none"),
    (["--skip-train", "--load", "EMPTY", "--save", "OUT"],
     r"--skip-train trains and saves nothing: expected no --save, got --save .*OUT"),
])
def test_skip_train_needs_a_checkpoint_and_no_save(tmp_path, flags, message) -> None:
    from hla_sp.launch.checks import ConfigError, validate
    from hla_sp.launch.config.train_config import parse_args

    (tmp_path / "EMPTY").mkdir()
    flags = [str(tmp_path / f) if f in ("EMPTY", "OUT") else f for f in flags]
    with pytest.raises(ConfigError, match=message):
        validate(parse_args([*RECALL, *flags], raise_errors=True), 1)
