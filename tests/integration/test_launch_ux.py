"""The trainer as a user meets it: one-line flag errors, torchrun spellings, a TOML
config, the dry-run's estimates, the progress line, TensorBoard/W&B, the live plot,
clean stops on a signal, OOM advice, and Megatron's entry point's --help."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from hla_sp.launch.checks import validate
from hla_sp.launch.cli import commands as cli
from hla_sp.launch.config.train_config import ConfigError, build_parser, flag_names, parse_args
from hla_sp.launch.distributed.local import worker_env
from hla_sp.launch.model import estimate
from hla_sp.launch.train import metrics

ROOT = Path(__file__).resolve().parents[2]
HLA_SP = os.path.join(os.path.dirname(sys.executable), "hla-sp")


# --- flags ----------------------------------------------------------------------------


def test_misspelt_flag_is_one_line_naming_the_nearest() -> None:
    p = subprocess.run([HLA_SP, "train", "--dry-run", "--seq-len", "4096"], capture_output=True,
                       text=True, env=worker_env(None), timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1, p.stderr  # no usage dump
    assert "--seq-len: did you mean --seq-length?" in p.stderr


def test_torchrun_underscore_spellings_are_accepted(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "--dry-run", "--nproc_per_node", "2", "--nnodes", "1",
                     "--max_restarts", "0", "--standalone", "--context-parallel-size", "2"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1]
    assert "--nproc-per-node 2" in cmd and "--standalone" in cmd
    assert cli.main(["train", "--dry-run", "--nproc_per_node", "2", "--nnodes", "2",
                     "--rdzv_endpoint", "node0:29400", "--node_rank", "1",
                     "--context-parallel-size", "4"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1]
    assert "--rdzv-endpoint node0:29400" in cmd and "--node-rank 1" in cmd


# --- --config run.toml ------------------------------------------------------------------


def _value_for(action: argparse.Action) -> object:
    """A value other than the default for every kind of trainer flag."""
    if action.dest == "custom_import":
        return "json"  # a module to import: one that registers nothing
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if isinstance(action, argparse.BooleanOptionalAction):
        return not action.default
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    d = action.default
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        value: object = d * 2 if d else 3  # custom types (--hla-short-conv) accept these
    else:
        value = {int: 3, float: 0.25}.get(action.type, "2")  # type: ignore[arg-type]
    return [value] if action.nargs == "+" else value


def test_every_trainer_flag_can_come_from_the_toml_file(tmp_path: Path) -> None:
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions
               if a.option_strings and a.dest not in ("config", "help")}
    assert set(flag_names()) - {"config"} == set(actions)
    lines, cli_argv = [], []
    for dest, action in actions.items():
        v = _value_for(action)
        lines.append(f"{dest} = {json.dumps(v)}")
        if isinstance(v, bool):
            flag = action.option_strings[0] if v else f"--no-{action.option_strings[0][2:]}"
            cli_argv.append(flag)
        else:
            cli_argv += [action.option_strings[0], *map(str, v if isinstance(v, list) else [v])]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    assert parse_args(["--config", str(tmp_path / "run.toml")]) == parse_args(cli_argv)


def test_toml_tables_group_keys_and_the_command_line_wins(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[model]\nnum-layers = 3\nhidden_size = 32\n[optim]\nlr = 0.01\n'
                 "hla_first_order = false\n")
    cfg = parse_args(["--config", str(f), "--lr", "0.5"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.optimizer.lr) == (3, 32, 0.5)
    assert cfg.hla.first_order is False


@pytest.mark.parametrize(("text", "needle"), [
    ("seq_len = 4096\n", "unknown key 'seq_len'; did you mean seq-length?"),
    ("seq_length = 'long'\n", "seq_length: expected an integer, got the string 'long'"),
    ("seq_length = \n", "not valid TOML"),
])
def test_bad_toml_names_the_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"run\.toml") as e:
        parse_args(["--config", str(f)], raise_errors=True)
    assert needle in str(e.value)


def test_hla_sp_train_reads_the_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "run.toml"
    f.write_text("context_parallel_size = 2\nseq_length = 130\n")
    assert cli.main(["train", "--dry-run", "--nproc-per-node", "2", "--config", str(f)]) == 2
    assert "--seq-length 128 or 132" in capsys.readouterr().err


# --- the cluster command: positions, estimates ---------------------------------------------


def test_learned_positions_refused_at_long_context_with_the_table_size() -> None:
    cfg = parse_args(["--seq-length", "1048576", "--hidden-size", "2048",
                      "--num-attention-heads", "16"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert "1,048,576 x 2048 = 2.15 B parameters" in str(e.value)
    assert "rope" in str(e.value) and "none" in str(e.value)
    validate(parse_args(["--seq-length", "65536"]), 1)  # at the threshold: allowed


def test_dry_run_prints_counts_memory_and_flops(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "--dry-run", "--seq-length", "65536", "--num-layers", "2",
                     "--hidden-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "position table 4.19 M" in out and "2 layers x" in out
    assert "memory per rank" in out and "TFLOP per step" in out
    assert "warning: the position table (4.19 M) holds more parameters" in out


def test_dry_run_warns_when_memory_exceeds_the_device(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "--dry-run", "--device-memory", "1", "--seq-length", "65536",
                     "--hidden-size", "256", "--num-attention-heads", "4",
                     "--position-embedding-type", "none"]) == 0
    warn = [x for x in capsys.readouterr().out.splitlines() if "exceeds" in x]
    assert len(warn) == 1 and "--device-memory 1 GiB" in warn[0]
    assert "--recompute-granularity full gives" in warn[0] or "--context-parallel-size" in warn[0]


def test_parameter_count_matches_the_built_model() -> None:
    """The formula against megatron-core's model (tiny, on CPU)."""
    from hla_sp.launch.distributed.process_groups import init_distributed, shutdown
    from hla_sp.launch.model.build import build_model

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "128"])
    topo = init_distributed(1, 1, 1)
    try:
        n = sum(p.numel() for p in build_model(cfg, 257).parameters())
    finally:
        shutdown(topo)
    assert estimate.estimate(cfg, 1).total == n


def test_memory_model_reproduces_the_measured_million_token_run() -> None:
    """docs/launch.md's model against benchmarks/results/long_context.json (CP=4, 1M)."""
    res = json.loads((ROOT / "benchmarks/results/long_context.json").read_text())
    (row,) = [r for r in res["lengths"] if r["seq_length"] == 1048576]
    cfg = parse_args(["--seq-length", "1048576", "--context-parallel-size", "4",
                      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                      "--position-embedding-type", "none", "--make-vocab-size-divisible-by", "1",
                      "--recompute-granularity", "full"])
    got = estimate.estimate(cfg, 4).memory_bytes / 2**30
    assert abs(got - row["peak_mem_gib_max"]) / row["peak_mem_gib_max"] < 0.05, got


def test_advice_says_what_to_change_and_by_how_much() -> None:
    cfg = parse_args(["--seq-length", "65536", "--hidden-size", "512", "--num-attention-heads",
                      "8", "--micro-batch-size", "2", "--position-embedding-type", "none"])
    text = estimate.advice(cfg, 1)
    assert text.startswith("the memory model gives")
    for change in ("--recompute-granularity full gives", "--context-parallel-size 2",
                   "--micro-batch-size 1"):
        assert change in text
    assert "GiB" in text and "\n" not in text


def test_oom_is_one_line_of_advice_without_a_traceback(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from hla_sp.launch.train import main as train

    def oom(self: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(train.Trainer, "step", oom)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            train.run(parse_args(["--train-iters", "2"]), exit_on_error=False)
    finally:
        # run() re-raises without shutting the group down (a Ray worker's process ends
        # next); this process goes on to other tests, which start groups of their own,
        # Megatron's model-parallel groups included
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "out of memory;" in x]
    assert "--recompute-granularity full gives" in line


def test_weights_are_created_on_the_device_on_cuda() -> None:
    from hla_sp.launch.model.build import transformer_config

    cfg = parse_args([])
    assert transformer_config(cfg, torch.device("cpu")).use_cpu_initialization
    assert transformer_config(cfg).use_cpu_initialization
    assert not transformer_config(cfg, torch.device("cuda", 0)).use_cpu_initialization


# --- logs -----------------------------------------------------------------------------------


def test_progress_line_has_tokens_elapsed_eta_and_tflops() -> None:
    rec = {"iteration": 10, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4,
           "step_time_s": 0.5, "peak_mem_bytes": 2**30, "peak_mem_bytes_per_rank": [2**30] * 2,
           "consumed_tokens": 1_310_720, "tflops_per_rank": 0.25, "tflops_total": 0.5,
           "elapsed_s": 125.0, "eta_s": 3725.0}
    line = metrics.progress_line(rec, 40)
    assert "0.25 TFLOP/s per rank (0.5 total)" in line and "1.31M tokens" in line
    assert "elapsed 2m05s, ETA 1h02m" in line


def test_live_plot_is_drawn_during_the_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    jsonl = tmp_path / "m.jsonl"
    log = metrics.JsonlLog(str(jsonl))
    log.write({"iteration": 1, "loss": 3.0, "tokens_per_s": 10.0})
    plot = metrics.LivePlot(str(jsonl), min_interval_s=0)
    plot.draw()
    png = tmp_path / "m.png"
    first = png.stat().st_mtime_ns
    log.write({"iteration": 2, "loss": 2.5, "tokens_per_s": 11.0})
    time.sleep(0.01)
    plot.draw()
    assert png.stat().st_mtime_ns > first


def test_tensorboard_and_wandb_get_the_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            calls.append(("tb", log_dir))

        def add_text(self, *a: object) -> None: ...

        def add_scalar(self, name: str, v: float, step: int) -> None:
            calls.append((name, v, step))

        def close(self) -> None:
            calls.append(("closed",))

    run = types.SimpleNamespace(log=lambda values, step: calls.append(("wandb", values, step)),
                                finish=lambda: calls.append(("finished",)))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: run))
    cfg = parse_args(["--tensorboard-dir", "tb", "--wandb-project", "p"])
    s = metrics.Scalars(cfg)
    s.write({"iteration": 4, "loss": 2.0, "lr": 0.1, "tokens_per_s": 5.0})
    s.close()
    assert ("tb", "tb") in calls and ("train/loss", 2.0, 4) in calls
    assert ("wandb", {"train/loss": 2.0, "train/lr": 0.1, "perf/tokens_per_s": 5.0}, 4) in calls
    assert ("closed",) in calls and ("finished",) in calls


@pytest.mark.parametrize(("flag", "module", "needle"), [
    ("--tensorboard-dir", "tensorboard", 'pip install "hla-sp[tensorboard]"'),
    ("--wandb-project", "wandb", "pip install wandb"),
])
def test_missing_logger_package_is_a_clear_error(
        flag: str, module: str, needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ConfigError, match=flag) as e:
        validate(parse_args([flag, "x"]), 1)
    assert needle in str(e.value)


# --- signals (real runs: 2 gloo ranks under hla-sp train) ------------------------------


def _run_until_then_signal(tmp_path: Path, extra: list[str], sig: int) -> tuple[int, str]:
    argv = [HLA_SP, "train", "--nproc-per-node", "2", "--context-parallel-size", "2",
            "--seq-length", "64", "--num-layers", "1", "--hidden-size", "32",
            "--train-iters", "100000", "--log-interval", "1", "--save", "ck",
            "--log-jsonl", "m.jsonl", *extra]
    p = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=worker_env(None))
    lines = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if line.startswith("iter     2/"):
                p.send_signal(sig)
                break
        rest, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, "".join(lines) + rest


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_exit_signal_handler_saves_plots_and_says_how_to_resume(tmp_path: Path, sig: int) -> None:
    rc, out = _run_until_then_signal(tmp_path, ["--exit-signal-handler"], sig)
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(sig).name} after iteration"), out[-2000:]
    assert "resume with: hla-sp train --nproc-per-node 2" in last and last.endswith("--load ck")
    it = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert it >= 2 and f"after iteration {it}/" in last
    if importlib_ok("matplotlib"):
        assert (tmp_path / "m.png").is_file()
    assert rc in (0, 128 + sig)


def test_without_the_flag_a_signal_is_one_line(tmp_path: Path) -> None:
    rc, out = _run_until_then_signal(tmp_path, [], signal.SIGINT)
    after = out.split("iter     2/", 1)[1].splitlines()[1:]
    stops = [x for x in after if "stopped by SIGINT" in x]
    assert len(stops) == 1, out[-3000:]
    assert "Traceback" not in out and "--exit-signal-handler" in stops[0]
    assert rc == 128 + signal.SIGINT


def importlib_ok(module: str) -> bool:
    from hla_sp.launch.extras import installed

    return installed(module)


# --- Megatron-LM's entry point ------------------------------------------------------------


def test_pretrain_gpt_help_works_and_lists_the_hla_flags() -> None:
    p = subprocess.run([sys.executable, "-m", "hla_sp.megatron_patch.pretrain_gpt", "--help"],
                       capture_output=True, text=True, env=worker_env(None), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--attention" in p.stdout and "--hla-decay" in p.stdout


def test_stray_percent_in_megatron_help_is_escaped() -> None:
    """megatron-core 0.18/0.19 have a help string ending in "10%)", which argparse's
    formatter rejects; the entry point escapes it and adds the HLA flags."""
    from hla_sp.megatron_patch.pretrain_gpt import escape_help, help_fixes

    assert escape_help("up to 10%) of x, %(default)s, 5%%") == \
        "up to 10%%) of x, %(default)s, 5%%"
    p = argparse.ArgumentParser(prog="megatron")
    p.add_argument("--num-layers", type=int, help="layers")
    p.add_argument("--overlap", type=float, default=0.1, help="share (default 10%)")
    with pytest.raises(ValueError):
        p.format_help()
    with help_fixes():
        text = p.format_help()
    assert "10%)" in text and "--attention" in text and "--hla-decay" in text


README_CLUSTER = [
    "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "HOST:29500",
    "--context-parallel-size", "16", "--seq-length", "1048576", "--num-layers", "24",
    "--hidden-size", "2048", "--num-attention-heads", "16", "--position-embedding-type",
    "rope", "--bf16", "--recompute-granularity", "full", "--train-iters", "20000",
    "--data-path", "/data/corpus_text_document", "--save", "/ckpt/run1", "--load", "/ckpt/run1",
]


def test_dry_run_plans_a_cluster_job_offline(capsys: pytest.CaptureFixture) -> None:
    """From a machine without the data, the checkpoint directory or CUDA: the plan opens
    no file, allows RoPE and bf16, assumes the vocabulary it is given, and plans for an
    accelerator (80 GiB unless told), never this machine's RAM."""
    assert not Path("/data/corpus_text_document.idx").exists()
    code = cli.main(["train", "--dry-run", *README_CLUSTER, "--vocab-size", "50257"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan: vocabulary 50,257 (--vocab-size), an assumed 80 GiB accelerator" in out
    assert "memory per rank" in out and "-m hla_sp.launch.train" in out
    code = cli.main(["train", "--dry-run", *README_CLUSTER, "--device-memory", "141"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--dry-run: expected --vocab-size with --data-path" in err[0]
