"""The save lock against the second pass of probes: ``--break-save-lock`` never breaks a
holder alive on this host; a run whose lock is removed or taken stops at its next save
before writing; every malformed lock (a directory, no permission, a NaN start time, a
dangling link, garbage) is one line naming the file and what to do."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import lock
from hla_sp.launch.config.train_config import parse_args

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2"]  # fmt: skip


def _plant(save: Path, **fields: object) -> Path:
    save.mkdir(parents=True, exist_ok=True)
    rec = {"host": socket.gethostname(), "pid": os.getppid(), "proc_start": None,
           "started": 1_700_000_000.0, "job": None, "token": "theirs", "run": None, **fields}
    path = save / checkpoint.LOCK
    path.write_text(json.dumps(rec))
    return path


def test_break_save_lock_never_breaks_a_live_holder_on_this_host(tmp_path: Path) -> None:
    """Probe 1: the second run's --break-save-lock took a live run's lock."""
    save = tmp_path / "s"
    path = _plant(save)  # our parent process: alive, on this host
    cfg = parse_args([*TINY, "--save", str(save), "--break-save-lock"])
    for attempt in (lambda: checkpoint.preflight(cfg),
                    lambda: checkpoint.SaveLock(str(save)).acquire(break_lock=True)):
        with pytest.raises(checkpoint.SaveLockError) as e:
            attempt()
        msg = str(e.value)
        assert "\n" not in msg and f"pid {os.getppid()} on this host, is still running" in msg
        assert msg.startswith(f"--save {save}: --break-save-lock refused"), msg
    assert json.loads(path.read_text())["token"] == "theirs"  # untouched


def _save(root: Path, it: int) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0, writes_model=True,
                    model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                    consumed_samples=it, config={})  # fmt: skip


def test_a_run_whose_lock_is_gone_or_taken_stops_before_writing(tmp_path: Path,
                                                                 group: None) -> None:
    """Probe 1, the other half: the first run trained on without its lock."""
    save = tmp_path / "s"
    mine = checkpoint.SaveLock(str(save))
    mine.acquire()
    try:
        _save(save, 1)  # held: saves
        (save / checkpoint.LOCK).unlink()
        with pytest.raises(checkpoint.SaveLockError) as e:
            _save(save, 2)
        assert str(e.value).startswith(f"--save {save}: this run's lock {save / 'save.lock'} "
                                       f"was removed (another run or a person took the "
                                       f"directory); stopped before writing iteration 2's")
        assert checkpoint.complete_iterations(str(save)) == [1]
        assert not (save / "iter_0000002.tmp").exists()
        other = checkpoint.SaveLock(str(save))
        other.acquire()
        mine2 = checkpoint.SaveLock(str(save))  # taken by another run after ours
        mine2.held = True
        lock._held[mine2.token] = mine2
        with pytest.raises(checkpoint.SaveLockError, match=r"now holds host .*pid"):
            _save(save, 3)
        assert (save / checkpoint.LOCK).exists()  # the other run's lock stays
        other.release()
    finally:
        lock.release_all()


@pytest.mark.parametrize("kind", ["directory", "eacces", "nan", "dangling", "garbage"])
def test_every_malformed_lock_is_one_line_naming_the_file_and_what_to_do(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe 6: tracebacks for a directory, EACCES or NaN; "other runs keep taking it"
    for a dangling link; "on another host" for garbage."""
    save = tmp_path / "s"
    save.mkdir()
    path = save / checkpoint.LOCK
    want = {"directory": "a directory", "eacces": "permission denied",
            "nan": "not a lock record", "dangling": "a symbolic link to",
            "garbage": "not a lock record"}[kind]
    if kind == "directory":
        path.mkdir()
    elif kind == "eacces":
        path.write_text("{}")
        path.chmod(0)
        if os.geteuid() == 0:  # root reads any file: the open fails as it would for a user
            def denied(name: object, *a: object, **k: object) -> object:
                if str(name) == str(path):
                    raise PermissionError(13, "Permission denied", str(name))
                return open(name, *a, **k)  # type: ignore[call-overload]

            monkeypatch.setattr(lock, "open", denied, raising=False)
    elif kind == "nan":
        _plant(save, started=float("nan"))
    elif kind == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    else:
        path.write_bytes(b"\x00garbage")
    cfg = parse_args([*TINY, "--save", str(save)])
    for attempt in (lambda: checkpoint.preflight(cfg),
                    lambda: checkpoint.SaveLock(str(save)).acquire()):
        with pytest.raises(checkpoint.SaveLockError) as e:
            attempt()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{path}: ") and want in msg, msg
        assert "delete" in msg or "remove" in msg or "fix its permissions" in msg, msg
    assert os.path.lexists(path)
