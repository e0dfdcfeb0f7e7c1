"""--compile: each transformer layer through ``torch.compile(fullgraph=True)``.

Layers, not the whole model: the embedding, the loss and the trainer's Python stay
eager. Full activation recompute (:func:`hla_sp.launch.model.build.apply_recompute`) wraps
the compiled forward, so the recomputation in backward runs the compiled code too;
selective recompute's checkpoint sits inside the layer, and dynamo traces it into the
graph. HLA's chunk scan is a torch custom op, opaque to the compiler, and under context
parallelism the exchanges between ranks trace as functional collectives: the graph holds
whole at any CP size (tensor parallelism does not: refused by the checks).
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["BACKEND_ENV", "compile_layers"]

# The compiler backend (default inductor). aot_eager traces the same graphs, forward and
# backward, without generating code: a fullgraph check in seconds, not minutes.
BACKEND_ENV = "HLA_SP_COMPILE_BACKEND"


def compile_layers(model: torch.nn.Module) -> int:
    """Replace each decoder layer's forward by its fullgraph compilation; returns how
    many layers were compiled. Must run before recompute wraps the forwards."""
    layers = list(model.decoder.layers)
    # every layer shares one code object; each may need a graph with grad on (training,
    # recompute's second pass), one with it off (recompute's first pass) and one for
    # evaluation, so the default limit (8) would fall back to eager past a few layers
    limit = 4 * len(layers)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    # past the limit dynamo would run a layer eagerly without a word: stop instead
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # megatron-core's row-parallel linear calls a helper that, on rank 0 only, warns
    # (DeprecationWarning, hidden by default) that it fell back to the default TP group;
    # dynamo cannot trace warnings.warn, and a break on one rank would leave the ranks
    # with different graphs. Inside the compiled layers such warnings are dropped.
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    _build_sequence_parallel(model)
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    for layer in layers:
        layer.forward = torch.compile(layer.forward, fullgraph=True, backend=backend)
    return len(layers)


def _build_sequence_parallel(model: torch.nn.Module) -> None:
    """Build each HLA core attention's SequenceParallel (its CP exchange plan) now: it is
    made on the first call otherwise, inside the compiled graph, where dynamo cannot
    trace its construction (process-group lookups); a cached one traces."""
    from hla_sp.megatron_patch.checks import hla_report

    cores = dict(model.named_modules())
    for where in hla_report(model)[0]:
        core = cores[where]
        core._sequence_parallel(core._cp_group(None))
