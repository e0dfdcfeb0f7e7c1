"""The trainer's model on a CUDA device: every weight created there, not on the host.

Skipped without a GPU (CPU runs build with ``use_cpu_initialization``, checked in
tests/integration/test_launch_ux.py); ``benchmarks/gpu_check.sh`` runs it on the GPU machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_model_is_built_on_the_device_and_trains_there() -> None:
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.export.generate import single_process
    from hla_sp.launch.model.build import build_model

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "128", "--attention", "hla2"])
    dev = torch.device("cuda", torch.cuda.current_device())
    warnings.simplefilter("ignore")
    with single_process():
        model = build_model(cfg, 257, dev)
        where = {n: p.device for n, p in model.named_parameters()}
        assert all(d.type == "cuda" for d in where.values()), where
        tokens = torch.randint(0, 257, (2, 128), device=dev)
        pos = torch.arange(128, device=dev)[None].expand(2, -1)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None and p.grad.device.type == "cuda"
                   for p in model.parameters() if p.requires_grad)
