"""The Ray sweep: the shipped examples run, errors name the file and key before Ray
starts, output is clean, and nothing of Ray outlives the driver."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.train")

from hla_sp.launch.sweep import ray_sweep

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")


def test_json_and_toml_examples_are_the_same_sweep() -> None:
    toml = ray_sweep.load_config(str(ROOT / "examples" / "sweep.toml"))
    assert ray_sweep.load_config(str(ROOT / "examples" / "sweep.json")) == toml
    assert max(toml["world_sizes"]) < toml["ray"]["num_cpus"]  # it passes its own check


def _procs_mentioning(needle: str) -> list[str]:
    """Command lines of live processes that contain ``needle`` (Ray's session dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def _run_sweep(sweep_file: Path, tmp_path: Path) -> tuple[list[dict], str, Path]:
    """``hla-sp sweep FILE`` in a subprocess: its rows, its output, its output folder.
    Checks that it succeeds and that no Ray process outlives the driver."""
    out = tmp_path / "out"
    # Ray's sockets live under its temp dir; a short path keeps them under 107 bytes
    ray_tmp = tempfile.mkdtemp(prefix="hr", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "RAY_TMPDIR": ray_tmp}
    try:
        p = subprocess.run(
            [HLA_SP, "sweep", str(sweep_file), "--output-dir", str(out)],
            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
        )  # fmt: skip
        text = p.stdout + p.stderr
        assert p.returncode == 0, text[-5000:]
        deadline = time.monotonic() + 20
        while _procs_mentioning(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _procs_mentioning(ray_tmp), _procs_mentioning(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return json.loads((out / "results.json").read_text()), text, out


def _check_sweep(rows: list[dict], text: str, out: Path, points: list[tuple[int, int]]
                 ) -> None:
    """Results, CSV and plots for every (P, T) point; each worker line once; no Ray noise."""
    assert [(r["world_size"], r["cp"], r["seq_length"]) for r in rows] == [
        (P, P, T) for P, T in points]
    for r in rows:
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert len(r["peak_mem_bytes_per_rank"]) == r["world_size"]
        assert min(r["peak_mem_bytes_per_rank"]) > 0
        assert r["iters"] == 2 and r["loss_first"] > 0
    with open(out / "results.csv") as f:
        assert [int(row["seq_length"]) for row in csv.DictReader(f)] == [T for _, T in points]
    for name in ("throughput_vs_p.png", "memory_vs_seq.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [ln for ln in text.splitlines() if ln.startswith("[sweep P=")]
    assert any("iter     2/2" in ln for ln in lines), text[-3000:]
    assert len(lines) == len(set(lines)), "a worker line was printed twice"
    for noise in ("PlacementGroupCleaner", "TrainController", "core_worker.cc"):
        assert noise not in text, noise


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for leftover processes")
def test_one_point_sweep_runs_clean_and_leaves_nothing(tmp_path: Path) -> None:
    """The example's cluster and trainer sections at one point, P = 2 (CP across two Ray
    workers), T = 64: the whole path of a sweep at a quarter of the example's cost."""
    example = (ROOT / "examples" / "sweep.toml").read_text()
    one = example.replace("world_sizes = [1, 2]", "world_sizes = [2]").replace(
        "seq_lengths = [64, 128]", "seq_lengths = [64]")
    assert one.count("world_sizes = [2]") == 1 and one.count("seq_lengths = [64]") == 1, (
        "examples/sweep.toml's grid lines changed: update this test")
    path = tmp_path / "one.toml"
    path.write_text(one)
    _check_sweep(*_run_sweep(path, tmp_path), points=[(2, 64)])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for leftover processes")
def test_example_sweep_runs_clean_and_leaves_nothing(tmp_path: Path) -> None:
    """examples/sweep.toml end to end (P = 1, 2; T = 64, 128)."""
    _check_sweep(*_run_sweep(ROOT / "examples" / "sweep.toml", tmp_path),
                 points=[(1, 64), (1, 128), (2, 64), (2, 128)])


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("missing.toml", None, "missing.toml: no such file"),
        ("sweep.yaml", "world_sizes: [1]", "sweep.yaml: expected a .json or .toml sweep file"),
        ("bad.json", "{", "bad.json: not valid JSON"),
        ("key.toml", "world_sizes = [1]\nseq_lengths = [64]\n[trainer]\nhiden_size = 32\n",
         "key.toml: [trainer] hiden_size: not a trainer flag"),
        ("value.toml", "world_sizes = [1]\nseq_lengths = [64]\n[trainer]\nhidden_size = 'x'\n",
         "value.toml: [trainer] hidden_size = 'x': argument --hidden-size: invalid int"),
        ("cpus.toml", "world_sizes = [1, 4]\nseq_lengths = [64]\n[ray]\nnum_cpus = 2\n",
         "cpus.toml: [ray] num_cpus: the local cluster has 2 CPUs, and the largest world "
         "size in world_sizes needs 4"),
        ("grid.toml", "world_sizes = [3]\nseq_lengths = [64]\n",
         "grid.toml: world size 3, seq length 64: --seq-length 64 is not divisible"),
        ("list.toml", "world_sizes = 2\nseq_lengths = [64]\n", "list.toml: world_sizes: expected"),
    ],
)
def test_config_errors_name_the_file_and_key_before_ray_starts(
    tmp_path: Path, name: str, content: str | None, needle: str,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    def no_ray(*a: object, **k: object) -> None:
        raise AssertionError("Ray started before the sweep file was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert ray_sweep.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hla-sp sweep: error: "), err
    assert needle in err, err


def test_plots_use_whole_ranks_and_a_zero_based_memory_axis() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [{"world_size": p, "seq_length": t, "tokens_per_s": 1000.0 * p,
           "peak_mem_bytes_max": 2**30 + 7 * 2**20 * (t // 64)}
          for p in (1, 2, 4) for t in (64, 128)]
    fig = ray_sweep.throughput_figure(ok)
    assert list(fig.axes[0].get_xticks()) == [1, 2, 4]
    plt.close(fig)
    fig = ray_sweep.memory_figure(ok)
    lo, hi = fig.axes[0].get_ylim()
    assert lo == 0 and hi > 1.0  # a 7 MB difference on a 1 GiB level stays flat
    plt.close(fig)
