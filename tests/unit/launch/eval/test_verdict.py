"""A passkey run that retrieves no key says it is at chance and what size of model is
expected to retrieve (hla_sp.launch.eval.verdict); other results say nothing more."""

from __future__ import annotations

from hla_sp.launch.eval.verdict import approx_parameters, passkey_verdict

MODEL = {"hidden_size": 64, "num_layers": 2, "vocab_size": 257}


def _record(accuracies: list[float], logp: float = -3.1, task: str = "passkey") -> dict:
    return {"task": task, "model": MODEL, "results": [
        {"accuracy": a, "depths": [{"digit_logprob": logp}, {"digit_logprob": logp + 0.2}]}
        for a in accuracies]}


def test_at_chance_says_so_and_the_size_expected() -> None:
    assert approx_parameters(MODEL) == 12 * 2 * 64 * 64 + 257 * 64  # 114,752
    line = passkey_verdict(_record([0.0, 0.0]))
    assert line == (
        "passkey: no key retrieved at any length or depth, which is chance (a guess finds a "
        "5-digit key once in 100,000); mean digit log-prob -3.00, below a uniform guess's "
        "-2.30. Expected for a model of about 0.11 M parameters: published passkey retrieval "
        "comes from models trained for it or pretrained on natural text at the tested "
        "length, of hundreds of millions of parameters and more (docs/eval.md)")


def test_retrieval_or_another_task_says_nothing_more() -> None:
    assert passkey_verdict(_record([0.0, 0.25])) is None
    assert passkey_verdict(_record([0.0], task="ppl-by-position")) is None
    assert passkey_verdict(_record([])) is None
