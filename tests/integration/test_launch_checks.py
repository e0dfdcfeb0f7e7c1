"""Impossible runs refused before launch, naming the flag or file; failure messages
that tell the truth (issue 10, items 5 and 6). All in-process and fast: no torchrun."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ckpt_formats import without_manifest_as_format_2
from conftest import FakeStore
from hla_sp.launch import checkpoint
from hla_sp.launch.checks import validate
from hla_sp.launch.cli.commands import main as cli_main
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed import faults

# --- flags ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("--micro-batch-size 0", "--micro-batch-size: expected a finite value in [1, inf], got 0"),
        ("--micro-batch-size -1", "--micro-batch-size: expected a finite value in [1, inf], got -1"),  # noqa: E501
        ("--num-layers 0", "--num-layers: expected a finite value in [1, inf], got 0"),
        ("--num-attention-heads 0", "--num-attention-heads: expected"),
        ("--global-batch-size 0", "--global-batch-size: expected"),
        ("--lr nan", "--lr: expected a finite value in [0, inf], got nan"),
        ("--lr -0.1", "--lr: expected a finite value in [0, inf], got -0.1"),
        ("--hidden-dropout 1.5", "--hidden-dropout: expected a finite value in [0, 1), got 1.5"),
        ("--adam-beta1 2", "--adam-beta1: expected a finite value in [0, 1), got 2.0"),
        ("--vocab-size 0", "--vocab-size: expected a finite value in [1, inf], got 0"),
        ("--seed -1", "--seed: expected"),
        ("--adam-eps 0", "--adam-eps: expected a finite value in (0, inf], got 0.0"),
        ("--lr 1e38", "--lr: expected at most 3.4e+37 (AdamW's first step is --lr / "
                      "(1 - --adam-beta1) = 1e+39, past fp32's largest number), got 1e+38"),
    ],
)
def test_impossible_flags_are_refused_by_name(argv: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(parse_args(argv.split()), 1)
    assert needle in str(e.value)


def test_zero_world_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="world size: expected >= 1 process"):
        validate(parse_args([]), 0)


@pytest.mark.parametrize(
    ("launch", "needle"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node: expected >= 1, got 0"),
        (["--nnodes", "two"], "--nnodes: expected N or MIN:MAX with N >= 1, got 'two'"),
        (["--nnodes", "0"], "--nnodes: expected N or MIN:MAX"),
        (["--max-restarts", "-1"], "--max-restarts: expected >= 0, got -1"),
    ],
)
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_cli_refuses_before_torchrun(
    launch: list[str], needle: str, dry: bool, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))
    rc = cli_main(["train", *launch, *(["--dry-run"] if dry else [])])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_dry_run_runs_the_trainer_checks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))
    assert cli_main(["train", "--dry-run", "--micro-batch-size", "0"]) == 2
    assert "--micro-batch-size: expected" in capsys.readouterr().err


# --- datasets ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Megatron indexed dataset (uint16 tokens), made by the project's tool."""
    d = tmp_path_factory.mktemp("ds")
    (d / "in").mkdir()
    for i in range(3):
        (d / "in" / f"{i}.txt").write_text(f"document {i} " * 20)
    p = subprocess.run(
        [sys.executable, "-m", "hla_sp.launch.make_dataset", "--input", str(d / "in"),
         "--output-prefix", str(d / "ds")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return d / "ds"


def _corrupt(src: Path, dst: Path, which: str, size: int | None) -> str:
    """Copy the pair to ``dst``, then cut ``which`` (".bin"/".idx") to ``size`` bytes."""
    for ext in (".bin", ".idx"):
        data = Path(str(src) + ext).read_bytes()
        if ext == which:
            data = data[: (len(data) + size if size < 0 else size)] if size is not None else data
        Path(str(dst) + ext).write_bytes(data)
    return str(dst)


@pytest.mark.parametrize(
    ("which", "size", "needle"),
    [
        (".bin", 0, ".bin: empty file (0 bytes)"),
        (".bin", -2, ".bin: truncated"),  # whole tokens missing
        (".bin", -1, "is not a whole number of 2-byte tokens"),  # cut mid-token
        (".idx", 0, ".idx: empty file (0 bytes)"),
        (".idx", 20, "not a Megatron indexed-dataset index"),
        (".idx", -8, ".idx: truncated"),
    ],
    ids=["bin-empty", "bin-even", "bin-odd", "idx-empty", "idx-header", "idx-truncated"],
)
def test_broken_dataset_refused_before_launch_naming_the_file(
    dataset: Path, tmp_path: Path, which: str, size: int, needle: str
) -> None:
    prefix = _corrupt(dataset, tmp_path / "bad", which, size)
    with pytest.raises(ConfigError) as e:
        validate(parse_args(["--data-path", prefix]), 1)
    msg = str(e.value)
    assert needle in msg and prefix + which in msg, msg


def test_intact_dataset_passes(dataset: Path) -> None:
    validate(parse_args(["--data-path", str(dataset)]), 1)


# --- checkpoints ------------------------------------------------------------------



def _parts() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    return dict(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def _save(root: Path, it: int) -> str:
    return checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0, writes_model=True,
                           consumed_samples=it, config={}, **_parts())  # fmt: skip


def _load(root: Path) -> dict:
    return checkpoint.load(str(root), rank=0, world_size=1, tp_rank=0, **_parts())


def test_garbage_latest_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    latest = tmp_path / "c" / checkpoint.LATEST
    latest.write_bytes(b"\x00garbage\n")
    with pytest.raises(checkpoint.CheckpointError) as e:
        _load(tmp_path / "c")
    assert str(latest) in str(e.value) and "b'\\x00garbage\\n'" in str(e.value)
    # and the trainer refuses it before launching
    with pytest.raises(ConfigError, match="expected the number of the latest complete iteration"):
        validate(parse_args(["--load", str(tmp_path / "c")]), 1)


def test_empty_checkpoint_file_names_the_file(tmp_path: Path, group: None) -> None:
    d = _save(tmp_path / "c", 3)
    pt = Path(d) / checkpoint.COMMON
    pt.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError) as e:
        _load(tmp_path / "c")
    assert str(pt) in str(e.value) and "0 bytes" in str(e.value), str(e.value)


def test_missing_rng_file_named_and_not_bitwise(tmp_path: Path, group: None) -> None:
    d = _save(tmp_path / "c", 3)
    rng = Path(d) / "rng_rank00000.pt"
    rng.unlink()
    # a checkpoint without file digests (older): with them the missing file is refused
    without_manifest_as_format_2(Path(d))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _load(tmp_path / "c")["iteration"] == 3
    text = " ".join(str(x.message) for x in w)
    assert f"{rng} is missing" in text and "no longer bitwise" in text, text


def test_next_save_cleans_leftover_tmp(tmp_path: Path, group: None) -> None:
    root = tmp_path / "c"
    _save(root, 1)
    # an interrupted save at iteration 5, and an interrupted `latest` rewrite
    (root / "iter_0000005.tmp").mkdir()
    (root / "iter_0000005.tmp" / "model_optim_tp00.pt").write_bytes(b"partial")
    (root / f"{checkpoint.LATEST}.tmp12345").write_bytes(b"")
    _save(root, 10)
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000010", checkpoint.LATEST,
    ]


def test_full_disk_names_enospc_and_the_file(
    tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.save

    def full(obj: object, f: object, *a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as e:
        _save(tmp_path / "c", 1)
    monkeypatch.setattr(torch, "save", real)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(tmp_path / "c" / "iter_0000001.tmp" / checkpoint.COMMON)
    assert "disk full (ENOSPC)" in str(e.value)


# --- failure messages -------------------------------------------------------------


@pytest.fixture
def store(fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    monkeypatch.setattr(faults, "BEAT_S", 0.01)
    return fake_store


def _beat(store: FakeStore, rank: int, beat: int, it: int = 2, coll: bool = True) -> None:
    store.set(f"hla_sp/heartbeat/{rank}", json.dumps(
        {"beat": beat, "it": it, "at": "x.py:1 f", "coll": coll}))  # fmt: skip


def test_own_error_gives_no_diagnosis(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad lr or corrupt data is this rank's own error: no 'diagnosis' about the
    collective, and the cause is published for the peers."""
    _beat(store, 1, 5)
    faults.report_failure(0, 2, ValueError("loss is nan at iteration 3"))
    err = capsys.readouterr().err
    assert "training stopped by ValueError: loss is nan at iteration 3" in err
    assert "diagnosis" not in err and "collective itself" not in err
    assert "this rank's own error" in err
    assert json.loads(store.get("hla_sp/failed/0"))["error"].startswith("ValueError: loss is nan")


def test_peer_crash_puts_the_real_cause_first(
    store: FakeStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The survivor names the root cause (connection closed) with the real elapsed time,
    not the wrapper's configured timeout, and the dead peer."""
    _beat(store, 0, 1)
    _beat(store, 1, 7)  # rank 1's beat does not move: it died
    monkeypatch.setattr(faults, "_progress", (2, faults.time.monotonic() - 0.7))
    try:
        try:
            raise dist.DistBackendError("Connection closed by peer [10.0.0.2]:1234")
        except dist.DistBackendError as inner:
            raise RuntimeError("not every rank joined the check within 600.0 s") from inner
    except RuntimeError as e:
        faults.report_failure(0, 2, e)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(
        "[hla-sp] rank 0/2: training stopped by DistBackendError: Connection closed by peer"
    ), lines
    assert "(0.7 s into iteration 3)" in lines[0]
    assert "raised as RuntimeError: not every rank joined the check within 600.0 s" in lines[1]
    assert "rank(s) 1 (last finished iteration 2) stopped responding" in lines[2]


def test_survivor_names_the_peers_own_error(
    store: FakeStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk rank 1 publishes ENOSPC and the path; rank 0 names that, not a
    dead peer."""
    monkeypatch.setattr(faults, "_progress", (2, faults.time.monotonic()))
    _beat(store, 0, 1)
    _beat(store, 1, 7)
    enospc = OSError(errno.ENOSPC, "disk full (ENOSPC) while writing", "/ckpt/iter_0000004.tmp/x")
    faults.report_failure(1, 2, enospc)
    first = capsys.readouterr().err.splitlines()[0]
    assert "ENOSPC (no space left on device) writing /ckpt/iter_0000004.tmp/x" in first
    faults.report_failure(0, 2, dist.DistBackendError("Connection closed by peer"))
    err = capsys.readouterr().err
    assert ("rank 1 stopped on its own error at iteration 3: OSError: ENOSPC (no space left "
            "on device) writing /ckpt/iter_0000004.tmp/x") in err, err
    assert "stopped responding" not in err


def test_collective_diagnosis_only_when_every_peer_is_fine(
    store: FakeStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    beats = iter(range(100))

    def read(s: object, n: int, prefix: str = "hla_sp/heartbeat/") -> dict:
        if prefix != "hla_sp/heartbeat/":
            return {r: None for r in range(n)}
        return {r: {"beat": next(beats), "it": 2, "at": "x", "coll": True} for r in range(n)}

    monkeypatch.setattr(faults, "_read", read)
    faults.report_failure(0, 2, dist.DistBackendError("gloo: mismatched collective"))
    assert "so the collective itself failed" in capsys.readouterr().err


def test_data_reader_names_a_broken_file(dataset: Path, tmp_path: Path) -> None:
    """Direct use of the reader (not only the trainer's check) names the file."""
    from hla_sp.launch.data.datasets import DatasetError, IndexedTokens

    prefix = _corrupt(dataset, tmp_path / "bad", ".bin", -2)
    with pytest.raises(DatasetError, match=r"bad\.bin: truncated"):
        IndexedTokens([prefix])
    assert np.asarray(len(IndexedTokens([str(dataset)]))) > 0
