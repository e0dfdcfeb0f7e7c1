"""The checkpoint format on one rank: optimizer state round trip, a crash while DCP
writes, a truncated tensor file, and the first format (one file per TP rank) read back."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hla_sp.launch import checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _parts(seed: int = 0, steps: int = 0) -> dict:
    """A small model and its AdamW (stepped ``steps`` times, so it has moments)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
    return dict(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def _save(root: Path, it: int, parts: dict) -> str:
    return checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0, writes_model=True,
                           consumed_samples=10 * it, config={"lr": 0.1}, **parts)  # fmt: skip


def _load(root: Path, parts: dict) -> dict:
    return checkpoint.load(str(root), rank=0, world_size=1, tp_rank=0, **parts)


def test_model_and_optimizer_state_round_trip(tmp_path: Path, group: None) -> None:
    saved = _parts(steps=2)
    d = _save(tmp_path / "c", 2, saved)
    fresh = _parts(seed=1)
    assert _load(tmp_path / "c", fresh) == {"iteration": 2, "consumed_samples": 20, "extra": {}}
    for a, b in zip(saved["model"].state_dict().values(), fresh["model"].state_dict().values()):
        assert torch.equal(a, b)
    want, got = saved["optimizer"].state_dict(), fresh["optimizer"].state_dict()
    assert want["param_groups"] == got["param_groups"] and sorted(got["state"]) == [0, 1, 2, 3]
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    # torch's own converter reads it: whole tensors under the model's names
    dcp_to_torch_save(str(Path(d) / checkpoint.SHARDED), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert torch.equal(whole["0.weight"], saved["model"][0].weight)
    assert torch.equal(whole["optimizer.state.exp_avg.1.bias"],
                       saved["optimizer"].state[saved["model"][1].bias]["exp_avg"])


def test_crash_while_dcp_writes_leaves_latest_on_the_last_complete(
    tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    _save(root, 1, _parts(steps=1))
    real = dcp.FileSystemWriter.write_data

    def crash(self: dcp.FileSystemWriter, plan: object, planner: object) -> object:
        (Path(self.path) / "__0_0.distcp").write_bytes(b"partial")  # as if killed half-way
        raise OSError(errno.EIO, "simulated crash while writing the tensors")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", crash)
    with pytest.raises(OSError) as e:
        _save(root, 2, _parts(steps=2))
    assert e.value.filename == str(root / "iter_0000002.tmp" / checkpoint.SHARDED)
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", real)
    assert checkpoint.latest_iteration(str(root)) == 1
    assert checkpoint.complete_iterations(str(root)) == [1]
    assert not (root / "iter_0000002").exists() and (root / "iter_0000002.tmp").is_dir()
    assert _load(root, _parts(seed=1))["iteration"] == 1
    _save(root, 3, _parts(steps=3))  # the next save removes what the crash left
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000003", checkpoint.LATEST]


def test_truncated_tensor_file_names_the_directory(tmp_path: Path, group: None) -> None:
    d = Path(_save(tmp_path / "c", 1, _parts(steps=1)))
    (part,) = (d / checkpoint.SHARDED).glob("*.distcp")
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    with pytest.raises(checkpoint.CheckpointError) as e:
        _load(tmp_path / "c", _parts(seed=1))
    msg = str(e.value)
    assert "\n" not in msg and str(d / checkpoint.SHARDED) in msg and "--ckpt-step" in msg, msg


def _first_format(d: Path, parts: dict, tp: int) -> None:
    """A checkpoint as the first format wrote it (one file per TP rank)."""
    d.mkdir(parents=True)
    for r in range(tp):
        torch.save({"model": parts["model"].state_dict(),
                    "optimizer": parts["optimizer"].state_dict(),
                    "scheduler": parts["scheduler"].state_dict(), "iteration": 3,
                    "consumed_samples": 30, "world_size": tp, "config": {"lr": 0.1}},
                   d / f"model_optim_tp{r:02d}.pt")  # fmt: skip
        torch.save({"rng": checkpoint.rng_state(), "world_size": tp}, d / f"rng_rank{r:05d}.pt")
    (d.parent / checkpoint.LATEST).write_text("3\n")


def test_first_format_still_loads_and_converts_on_the_next_save(
    tmp_path: Path, group: None
) -> None:
    old = _parts(steps=3)
    _first_format(tmp_path / "old" / "iter_0000003", old, tp=1)
    assert checkpoint.latest_iteration(str(tmp_path / "old")) == 3
    assert checkpoint.saved_config(str(tmp_path / "old"), 3) == {"lr": 0.1}
    fresh = _parts(seed=1)
    assert _load(tmp_path / "old", fresh)["iteration"] == 3
    assert torch.equal(fresh["model"][0].weight, old["model"][0].weight)
    _save(tmp_path / "new", 3, fresh)  # saved again: the current format
    names = sorted(p.name for p in Path(checkpoint.iter_dir(str(tmp_path / "new"), 3)).iterdir())
    assert names == ["common.pt", "config.json", "manifest.json", "model_optim",
                     "rng_rank00000.pt"]


def test_first_format_at_another_tp_is_refused_saying_how_to_convert(
    tmp_path: Path, group: None
) -> None:
    _first_format(tmp_path / "old" / "iter_0000003", _parts(steps=1), tp=2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        _load(tmp_path / "old", _parts(seed=1))
    msg = str(e.value)
    assert "\n" not in msg and "by 2 tensor-parallel ranks" in msg, msg
    assert "--tensor-model-parallel-size 2 (this run has 1); to convert it" in msg, msg
    # and before any process group, from the flags
    from hla_sp.launch.config.train_config import ConfigError, parse_args

    with pytest.raises(ConfigError, match="this run has 1"):
        checkpoint.preflight(parse_args(["--load", str(tmp_path / "old"), "--lr", "0.1"]))
    checkpoint.preflight(parse_args(["--load", str(tmp_path / "old"), "--lr", "0.1",
                                     "--tensor-model-parallel-size", "2"]))


def _piece(t: torch.Tensor, offset: int, rows: int, padded: bool = False) -> Any:
    from hla_sp.launch.checkpoint.sharded import Piece

    return Piece("emb", t, (offset, 0), (rows, t.shape[1]), True, padded)


def test_pieces_reshard_exactly(tmp_path: Path, group: None) -> None:
    """Two pieces of a tensor (as two TP ranks hold them) read back whole, and a whole
    tensor read back as pieces: the planners' overlaps, without megatron."""
    from hla_sp.launch.checkpoint import sharded

    full = torch.randn(6, 3, dtype=torch.float64)
    sharded.write(str(tmp_path / "two"), [_piece(full[:4], 0, 6), _piece(full[4:], 4, 6)])
    whole = torch.zeros(6, 3, dtype=torch.float64)
    sharded.read(str(tmp_path / "two"), [_piece(whole, 0, 6)])
    assert torch.equal(whole, full)
    sharded.write(str(tmp_path / "one"), [_piece(full, 0, 6)])
    parts = [torch.zeros(3, 3, dtype=torch.float64) for _ in range(2)]
    sharded.read(str(tmp_path / "one"), [_piece(parts[0], 0, 6), _piece(parts[1], 3, 6)])
    assert torch.equal(torch.cat(parts), full)


def test_padded_vocabulary_loads_the_rows_both_have(
    tmp_path: Path, group: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedding's rows are padded per TP size: another padded size loads the shared
    rows and zeroes the rest (as Megatron), silently: padding ids take no probability,
    so the model's function is unchanged; other tensors refuse it."""
    from hla_sp.launch.checkpoint import sharded

    monkeypatch.setattr(checkpoint.layout, "_warned", set())
    saved = torch.arange(12.0).reshape(6, 2)
    sharded.write(str(tmp_path / "d"), [_piece(saved, 0, 6, padded=True)])
    small, big = torch.full((4, 2), -1.0), torch.full((8, 2), -1.0)
    sharded.read(str(tmp_path / "d"), [_piece(small, 0, 4, padded=True)])
    sharded.read(str(tmp_path / "d"), [_piece(big, 0, 8, padded=True)])
    assert torch.equal(small, saved[:4]) and torch.equal(big[:6], saved) and not big[6:].any()
    assert capsys.readouterr().err == ""
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"emb is \(6, 2\) in the checkpoint, this model's is \(4, 2\)"):
        sharded.read(str(tmp_path / "d"), [_piece(small, 0, 4)])
