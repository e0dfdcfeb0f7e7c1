"""One run at a time per --save directory: the lock's record, a live holder refused in
one line naming it, a gone holder on this host taken over with one warning, another
host's holder refused naming --break-save-lock, every rank refusing together, the
preflight's check, and release on every exit of a real run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_flags
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import lock
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed.local import torchrun_argv, worker_env

TINY = tiny_flags(1, 32, "--lr", "3e-3", "--seed", "7", "--micro-batch-size", "2")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(save: Path, **fields: object) -> Path:
    """A lock file as another run would have left it."""
    save.mkdir(parents=True, exist_ok=True)
    rec = {"host": socket.gethostname(), "pid": 1, "proc_start": None,
           "started": 1_700_000_000.0, "job": "SLURM_JOB_ID=4242", "token": "theirs",
           "run": None, **fields}  # fmt: skip
    path = save / checkpoint.LOCK
    path.write_text(json.dumps(rec))
    return path


def test_lock_records_the_holder_and_refuses_a_second_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    save = tmp_path / "s"
    first = checkpoint.SaveLock(str(save))
    first.acquire()
    rec = json.loads((save / checkpoint.LOCK).read_text())
    assert rec["host"] == socket.gethostname() and rec["pid"] == os.getpid()
    assert rec["job"] == "SLURM_JOB_ID=77" and abs(rec["started"] - time.time()) < 60
    with pytest.raises(checkpoint.SaveLockError) as e:
        checkpoint.SaveLock(str(save)).acquire()
    msg = str(e.value)
    assert msg.startswith(f"--save {save}: in use by another run (host {socket.gethostname()}, "
                          f"pid {os.getpid()}, SLURM_JOB_ID=77, since ")
    assert "\n" not in msg and str(save / checkpoint.LOCK) in msg
    with pytest.raises(ConfigError, match="in use by another run"):  # the launcher's check
        checkpoint.preflight(parse_args([*TINY, "--save", str(save)]))
    first.release()
    first.release()  # twice is harmless
    assert not (save / checkpoint.LOCK).exists()
    checkpoint.preflight(parse_args([*TINY, "--save", str(save)]))
    with checkpoint.SaveLock(str(save)) as again:
        again.acquire()
    assert not (save / checkpoint.LOCK).exists()
    assert [p.name for p in save.iterdir()] == []  # no temporaries left


def test_gone_holder_on_this_host_is_taken_over_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "s"
    pid = _dead_pid()
    _plant(save, pid=pid)
    checkpoint.preflight(parse_args([*TINY, "--save", str(save)]))  # not refused
    mine = checkpoint.SaveLock(str(save))
    mine.acquire()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[hla-sp] warning: --save {save}: taking over the lock of a run whose "
                   f"process is gone (host {socket.gethostname()}, pid {pid}, "
                   f"SLURM_JOB_ID=4242, since 2023-11-14 22:13:20 UTC)"], err
    assert json.loads((save / checkpoint.LOCK).read_text())["token"] == mine.token
    mine.release()
    # a live pid that another process now has (its start differs) is gone as well
    _plant(save, pid=os.getppid(), proc_start="1")
    with checkpoint.SaveLock(str(save)) as taken:
        taken.acquire()
    assert "process is gone" in capsys.readouterr().err


def test_another_hosts_holder_is_refused_naming_the_flag_that_breaks_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "s"
    path = _plant(save, host="node-b17", pid=31337)
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(parse_args([*TINY, "--save", str(save)]))
    assert str(e.value) == (
        f"--save {save}: in use by another run (held by host node-b17, pid 31337, "
        f"SLURM_JOB_ID=4242, since 2023-11-14 22:13:20 UTC; {path}), on another host, so "
        f"whether it still runs cannot be told from here; if it does not, pass "
        f"--break-save-lock (or delete {path}), else --save another directory")
    with pytest.raises(checkpoint.SaveLockError, match="--break-save-lock"):
        checkpoint.SaveLock(str(save)).acquire()
    cfg = parse_args([*TINY, "--save", str(save), "--break-save-lock"])
    assert cfg.checkpoint.break_save_lock
    checkpoint.preflight(cfg)
    with checkpoint.SaveLock(str(save)) as mine:
        mine.acquire(break_lock=True)
    assert "taking over the lock of a run broken by --break-save-lock (host node-b17" \
        in capsys.readouterr().err
    path.write_bytes(b"\x00garbage")  # unreadable: nobody can say whose it is
    with pytest.raises(checkpoint.SaveLockError,
                       match=r"save.lock: not a lock record.*--break-save-lock"):
        checkpoint.SaveLock(str(save)).acquire()


def test_a_stale_lock_is_removed_only_if_unchanged(tmp_path: Path) -> None:
    """Two runs that both judged one lock stale: the slower one must not remove the lock
    the faster one has just taken in its place."""
    save = tmp_path / "s"
    path = _plant(save, pid=_dead_pid())
    stale = path.read_bytes()
    winner = checkpoint.SaveLock(str(save))
    path.unlink()
    winner.acquire()
    fresh = path.read_bytes()
    checkpoint.SaveLock(str(save))._remove_if(stale)  # the loser, late
    assert path.read_bytes() == fresh
    winner.release()


def _hold_on(rank: int, world_size: int, save: str) -> str:
    try:
        checkpoint.hold(save, rank)
    except checkpoint.SaveLockError as e:
        return str(e)
    lock.release_all()
    return "held"


def test_every_rank_refuses_when_rank_0_cannot_take_the_lock(
    tmp_path: Path, world: object
) -> None:
    save = tmp_path / "s"
    _plant(save, host="node-b17")
    got = world(2).run(_hold_on, str(save))  # type: ignore[operator]
    assert got[0] == got[1] and "--break-save-lock" in got[0], got
    (save / checkpoint.LOCK).unlink()
    assert world(2).run(_hold_on, str(save)) == ["held", "held"]  # type: ignore[operator]
    assert not (save / checkpoint.LOCK).exists()


def test_second_run_on_a_live_runs_save_is_refused_and_the_lock_goes_with_the_run(
    tmp_path: Path,
) -> None:
    """Run A holds --save (hanging in iteration 3, after saving 1 and 2); run B on the
    same directory is refused in one line naming A; A stopped by a signal releases it."""
    save = tmp_path / "ck"
    flags = [*TINY, "--train-iters", "5", "--save", str(save), "--load", str(save),
             "--save-interval", "1"]  # fmt: skip
    a = subprocess.Popen(torchrun_argv(1, flags), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=worker_env({"HLA_SP_FAULT": "0:3:hang"}))  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while checkpoint.complete_iterations(str(save)) != [1, 2]:
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()[0]
            time.sleep(0.5)
        holder = json.loads((save / checkpoint.LOCK).read_text())
        b = subprocess.run(torchrun_argv(1, flags), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=240, env=worker_env(None))
        assert b.returncode != 0
        lines = [x for x in b.stdout.splitlines() if "in use by another run" in x]
        assert len(lines) == 1, b.stdout[-3000:]
        assert (f"--save {save}: in use by another run (host {socket.gethostname()}, pid "
                f"{holder['pid']}, since ") in lines[0]
        assert checkpoint.complete_iterations(str(save)) == [1, 2]  # B wrote nothing
    finally:
        a.send_signal(signal.SIGTERM)  # as scancel does: torchrun passes it on
        try:
            out = a.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            raise
    assert not (save / checkpoint.LOCK).exists(), out[-3000:]
