"""Right answers in small places (issue 42, item 6), and generate's bad inputs refused
in one line (item 5): the resume line, several --config files, keys given twice,
values that read as flags, defaults on resume, zero-weight data, long prompts, and a
leftover of an interrupted save. All in-process, no torchrun."""

from __future__ import annotations

import argparse
import os
import shlex
import types
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from hla_sp.launch.checkpoint.resume_checks import config_diff
from hla_sp.launch.config.train_config import ConfigError, parse_args
from hla_sp.launch.distributed import signals
from hla_sp.launch.export import generate as gen

# --- the resume line -----------------------------------------------------------------------


def test_resume_line_drops_ckpt_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Following the line must continue from the newest checkpoint, not restart from
    the --ckpt-step the stopped run began at."""
    monkeypatch.setenv(signals.COMMAND_ENV, shlex.join(
        ["hla-sp", "train", "--nproc-per-node", "2", "--save", "ck", "--load", "ck",
         "--ckpt-step", "2", "--train-iters", "80"]))
    argv = shlex.split(signals.resume_command("ck", "ck"))
    assert argv == ["hla-sp", "train", "--nproc-per-node", "2", "--save", "ck", "--load", "ck",
                    "--train-iters", "80"]
    # from another directory: --load names --save instead (once), --ckpt-step=N goes too
    monkeypatch.setenv(signals.COMMAND_ENV, "hla-sp train --load old --ckpt-step=5 --save new")
    assert signals.resume_command("new", "old") == "hla-sp train --save new --load new"


# --- --config files ------------------------------------------------------------------------


def _toml(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_several_config_files_merge_in_order_command_line_last(tmp_path: Path) -> None:
    a = _toml(tmp_path, "a.toml", "[model]\nnum_layers = 3\nhidden_size = 96\n"
                                  "[train]\nlr = 0.01\nbf16 = true\n")
    b = _toml(tmp_path, "b.toml", "hidden_size = 128\nbf16 = false\nseq_length = 512\n")
    cfg = parse_args(["--config", a, "--config", b, "--seq-length", "1024"], raise_errors=True)
    assert cfg.model.num_layers == 3 and cfg.optimizer.lr == 0.01  # from a only
    # b replaces a, a false included
    assert cfg.model.hidden_size == 128 and cfg.precision.bf16 is False
    assert cfg.model.seq_length == 1024  # the command line last
    cfg = parse_args([f"--config={b}", "--config", a], raise_errors=True)
    assert cfg.model.hidden_size == 96 and cfg.precision.bf16 is True
    assert cfg.model.seq_length == 512


@pytest.mark.parametrize(("text", "needle"), [
    ("[model]\nseq_length = 128\n[run]\nseq_length = 256\n",
     "seq_length is given twice, as 'seq_length' in [model] and as 'seq_length' in [run]"),
    ("seq_length = 128\n[model]\nseq-length = 256\n",
     "seq_length is given twice, as 'seq_length' in the top level and as 'seq-length' in [model]"),
    # a section's table holds that section's keys: the one of another is named
    ("[data]\nseq_length = 256\n", "[data] seq_length: expected in [model], not in [data]"),
])
def test_a_key_given_twice_is_refused_naming_both_places(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = _toml(tmp_path, "run.toml", text)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", path], raise_errors=True)
    assert needle in str(e.value) and str(e.value).startswith(f"--config {path}: ")


@pytest.mark.parametrize(("text", "needle"), [
    ('data_path = ["x", "--num-layers", "7"]\n', "'--num-layers', which reads as a flag"),
    ('wandb_project = "--num-layers=7"\n', None),  # a scalar is one value, whatever it says
])
def test_values_cannot_inject_flags(tmp_path: Path, text: str, needle: str | None) -> None:
    path = _toml(tmp_path, "run.toml", text)
    if needle is None:
        cfg = parse_args(["--config", path], raise_errors=True)
        assert cfg.logging.wandb_project == "--num-layers=7" and cfg.model.num_layers == 2
        return
    with pytest.raises(ConfigError, match="data_path: expected values, got") as e:
        parse_args(["--config", path], raise_errors=True)
    assert needle in str(e.value)


def test_weights_in_a_config_list_stay_values(tmp_path: Path) -> None:
    path = _toml(tmp_path, "run.toml", 'data_path = [0.5, "A", 0.5, "B"]\n')
    assert parse_args(["--config", path], raise_errors=True).data.data_path == [
        "0.5", "A", "0.5", "B"]


# --- resume comparisons --------------------------------------------------------------------


def test_recorded_default_equals_the_explicit_value() -> None:
    saved = parse_args([]).to_dict()  # heads 4, hidden 64: defaults recorded as None
    assert saved["model"]["num_query_groups"] is None and saved["model"]["ffn_hidden_size"] is None
    now = parse_args(["--num-query-groups", "4", "--ffn-hidden-size", "256",
                      "--vocab-size", "257"]).to_dict()
    assert config_diff(saved, now) == []
    assert config_diff(now, saved) == []
    other = parse_args(["--num-query-groups", "2", "--ffn-hidden-size", "128"]).to_dict()
    assert config_diff(saved, other) == [
        "--num-query-groups 4 (checkpoint) != 2 (this run)",
        "--ffn-hidden-size 256 (checkpoint) != 128 (this run)",
    ]


# --- data ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two indexed datasets, all 'a' bytes and all 'b' bytes."""
    from hla_sp.launch.data.make_dataset import main as make_main

    d = tmp_path_factory.mktemp("blend")
    out = []
    for ch in "ab":
        (d / ch).mkdir()
        (d / ch / "t.txt").write_text(ch * 4000)
        assert make_main(["--input", str(d / ch), "--output-prefix", str(d / f"ds_{ch}")]) == 0
        out.append(str(d / f"ds_{ch}"))
    return out[0], out[1]


def test_a_zero_weight_source_supplies_nothing(two_datasets: tuple[str, str]) -> None:
    from hla_sp.launch.data.datasets import build_samples

    a, b = two_datasets
    s = build_samples("text", ["0", a, "1", b], 32, 0, 8)
    got = {int(s[i].tokens[0]) for i in range(64)}
    assert got == {ord("b")}, got
    mixed = build_samples("text", ["0.5", a, "0.5", b], 32, 0, 8)
    assert {int(mixed[i].tokens[0]) for i in range(8)} == {ord("a"), ord("b")}


# --- generate ------------------------------------------------------------------------------


def _request(**kw: object) -> argparse.Namespace:
    args = gen.build_parser().parse_args(["--load", "x"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize(("argv", "needle"), [
    (["--prompt", "ab\udcff"], "--prompt: expected UTF-8 text, got bytes that are not UTF-8 "
                               "at character 2 (b'\\xff')"),
    (["--temperature", "1e-310"], "--temperature: expected >= 0 (0: greedy; otherwise finite "
                                  "and at least 1e-06), got 1e-310"),
    (["--temperature", "inf"], "--temperature: expected >= 0"),
    (["--device", "gpu"], "--device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["--temperature", "warm"], "argument --temperature: invalid float value: 'warm'"),
])
def test_generate_refuses_bad_requests_in_one_line(
    tmp_path: Path, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before the checkpoint is read (--load names nothing here)."""
    with pytest.raises(SystemExit) if "warm" in argv else _nothing():
        assert gen.main(["--load", str(tmp_path / "nowhere"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hla-sp generate: error: "), err
    assert needle in err, err


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> bool:
        return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_generate_refuses_cuda_without_cuda() -> None:
    with pytest.raises(gen.GenerateError, match="--device cuda: expected a CUDA device, but "
                                                "this machine has none"):
        gen.check_request(_request(device="cuda"))


def test_generate_gives_the_right_limit_for_a_long_prompt() -> None:
    table = types.SimpleNamespace(num_embeddings=64)
    model = types.SimpleNamespace(embedding=types.SimpleNamespace(position_embeddings=table))
    with pytest.raises(gen.GenerateError) as e:
        gen.check_positions(model, 70, 5)  # type: ignore[arg-type]
    assert str(e.value) == ("--prompt: expected at most 64 tokens (the model's learned "
                            "positions, its --seq-length), got 70; shorten it by 6")
    with pytest.raises(gen.GenerateError, match=r"ask for at most 5$"):
        gen.check_positions(model, 60, 8)  # type: ignore[arg-type]
    gen.check_positions(model, 64, 1)  # the last token needs no position


# --- a leftover of an interrupted save ------------------------------------------------------


def test_space_check_names_a_leftover_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from hla_sp.launch.checkpoint import preflight_checks

    save = tmp_path / "ck"
    (save / "iter_0000004.tmp" / "model_optim").mkdir(parents=True)
    (save / "iter_0000004.tmp" / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 5000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight_checks.shutil, "disk_usage", lambda p: usage(1, 1, 1000))
    cfg = parse_args(["--save", str(save)])
    with pytest.raises(ConfigError) as e:
        preflight_checks.check_save_dir(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "free on its filesystem" in msg
    assert ("iter_0000004.tmp in it (0.00 GiB) is left over from an interrupted save" in msg
            and f"rm -r {save / 'iter_0000004.tmp'}" in msg), msg
    assert os.path.isdir(save / "iter_0000004.tmp")  # named, not deleted behind the user
