"""What a passkey result at chance means, in the closing lines of ``hla-sp eval``.

A sample counts as retrieved only when every token of the 5-digit key is the argmax,
so guessing retrieves one key in 100,000: a run that retrieves none is at chance, and
its mean digit log-prob says how far from a uniform guess among the ten digits
(ln 0.1 = -2.30 a byte) it is. Published passkey retrieval comes from models trained
for it, or pretrained on natural text at the tested length, of hundreds of millions of
parameters and more; the docs' tiny models (0.1 to 0.5 M parameters, trained on code in
windows of 256 to 1,024 bytes) are expected at chance (docs/eval.md, docs/quality.md).
"""

from __future__ import annotations

import math
from typing import Any

# a uniform guess among the ten digits, per digit (a byte with the default tokenizer)
GUESS_LOGPROB = math.log(0.1)


def approx_parameters(model: dict[str, Any]) -> int:
    """About how many parameters a GPT of ``model`` (the record's sizes) has: 12 h^2 a
    layer (attention 4 h^2, MLP 8 h^2) and the tied embedding."""
    h = model["hidden_size"]
    return 12 * model["num_layers"] * h * h + model["vocab_size"] * h


def passkey_verdict(record: dict[str, Any]) -> str | None:
    """One line when no length retrieved any key (None otherwise, or for other tasks)."""
    results = record.get("results", [])
    if record.get("task") != "passkey" or not results or any(
            r["accuracy"] > 0 for r in results):
        return None
    logps = [d["digit_logprob"] for r in results for d in r["depths"]]
    mean = sum(logps) / len(logps)
    than = "below" if mean < GUESS_LOGPROB else "above"
    n = approx_parameters(record["model"])
    return (f"passkey: no key retrieved at any length or depth, which is chance (a guess "
            f"finds a 5-digit key once in 100,000); mean digit log-prob {mean:.2f}, {than} a "
            f"uniform guess's {GUESS_LOGPROB:.2f}. Expected for a model of about "
            f"{n / 1e6:.2g} M parameters: published passkey retrieval comes from models "
            f"trained for it or pretrained on natural text at the tested length, of hundreds "
            f"of millions of parameters and more (docs/eval.md)")
