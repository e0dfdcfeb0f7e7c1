"""The trainer's config in sections: flags, TOML tables and saved configs fill the same
sections; each section checks itself; configs saved flat by earlier versions still load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hla_sp.launch.checkpoint.resume_checks import config_diff
from hla_sp.launch.config.train_config import (
    ConfigError,
    TrainConfig,
    build_parser,
    flat_config,
    parse_args,
)
from hla_sp.launch.model.config import ModelConfig
from hla_sp.launch.train.config import OptimizerConfig

ARGV = ["--num-layers", "3", "--hidden-size", "32", "--attention", "ahla", "--hla-decay",
        "data", "--lr", "0.01", "--bf16", "--data-path", "0.5", "A", "0.5", "B"]

# A config.json as the flat TrainConfig before sections wrote it (keys abridged: a key
# an older version did not record takes its default).
OLD_FLAT = {
    "num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 256,
    "lr": 0.01, "bf16": True, "data": "text", "data_path": ["0.5", "A", "0.5", "B"],
    "hla": {"attention": "ahla", "custom_import": [], "hla_decay": "data",
            "hla_chunk_size": 64, "hla_layer_pattern": None},
}


def test_flags_fill_the_sections() -> None:
    cfg = parse_args(ARGV)
    assert (cfg.model.num_layers, cfg.model.attention, cfg.optimizer.lr) == (3, "ahla", 0.01)
    assert cfg.precision.bf16 and cfg.data.data_path == ["0.5", "A", "0.5", "B"]
    assert (cfg.hla.operator, cfg.hla.decay) == ("ahla", "data")  # typed HLAConfig


def test_to_dict_writes_sections_and_round_trips_through_json() -> None:
    cfg = parse_args(ARGV)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["model"]["num_layers"] == 3 and d["hla"]["decay"] == "data"
    assert TrainConfig.from_dict(d) == cfg


def test_a_config_saved_flat_by_an_earlier_version_loads() -> None:
    cfg = TrainConfig.from_dict(OLD_FLAT)
    assert cfg == parse_args(ARGV)
    assert config_diff(OLD_FLAT, cfg.to_dict()) == []  # --load compares either form
    assert flat_config(cfg.to_dict())["hla"]["hla_decay"] == "data"
    # before sections, a config without --attention in its hla table was softmax
    assert TrainConfig.from_dict({"num_layers": 2}).model.attention == "softmax"


@pytest.mark.parametrize(("d", "needle"), [
    ({"num_layer": 2}, "unknown config keys ['num_layer']"),
    ({"hla": {"hla_decayy": "data"}}, "unknown keys ['hla_decayy'] in the config's hla table"),
    ({"model": {"lr": 0.1}}, "unknown keys ['lr'] in config section 'model'"),
    ({"model": {}, "optimiser": {}}, "unknown config sections ['optimiser']"),
])  # fmt: skip
def test_from_dict_names_an_unknown_key(d: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig.from_dict(d)


def test_toml_sections_fill_the_same_config(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[model]\nnum_layers = 3\nhidden-size = 32\nattention = "ahla"\n'
                 '[optimizer]\nlr = 0.01\n[precision]\nbf16 = true\n'
                 '[data]\ndata_path = [0.5, "A", 0.5, "B"]\n[hla]\ndecay = "data"\n')
    assert parse_args(["--config", str(f)], raise_errors=True) == parse_args(ARGV)


def test_a_key_in_the_wrong_section_is_one_line_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[optimizer]\nnum_layers = 3\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(f)], raise_errors=True)
    msg = str(e.value)
    assert "[optimizer] num_layers: expected in [model], not in [optimizer]" in msg, msg
    assert "\n" not in msg


def test_help_groups_flags_by_section() -> None:
    text = build_parser().format_help()
    order = [text.index(f"\n{s}:") for s in ("model", "optimizer", "precision", "parallelism",
                                              "data", "evaluation", "checkpoint", "logging")]
    assert order == sorted(order)
    assert order[0] < text.index("\n  --num-layers") < order[1] < text.index("\n  --lr ") < order[2]


def test_each_section_validates_itself() -> None:
    with pytest.raises(ConfigError, match="--hidden-size 30 is not divisible"):
        ModelConfig(hidden_size=30, num_attention_heads=4).validate()
    with pytest.raises(ConfigError, match=r"--min-lr 0\.1 must be <= --lr 0\.01"):
        OptimizerConfig(lr=0.01, min_lr=0.1).validate()
    with pytest.raises(ConfigError, match="--position-embedding-type: expected one of"):
        TrainConfig.from_dict({"model": {"position_embedding_type": "alibi"}}).model.validate()


def test_replace_takes_flat_names_and_keeps_hla_in_step() -> None:
    cfg = parse_args(ARGV)
    new = cfg.replace(seq_length=128, context_parallel_size=2)
    assert (new.model.seq_length, new.parallelism.context_parallel_size) == (128, 2)
    assert cfg.model.seq_length == 256  # a copy
    assert new.replace(attention="hla3").hla.operator == "hla3"
    with pytest.raises(ConfigError, match="unknown config field 'seq_len'"):
        cfg.replace(seq_len=1)


def test_hla_options_of_another_operator_are_one_line_at_parse() -> None:
    with pytest.raises(ConfigError, match="--hla-normalize: hla2 only, got --attention ahla"):
        parse_args(["--attention", "ahla", "--hla-normalize"], raise_errors=True)


def _rewrite_config(ckpt_dir: Path, config: dict) -> None:
    """Replace a checkpoint's config.json, recording its digest in the manifest (or the
    manifest check would refuse the edited file first)."""
    path = ckpt_dir / "config.json"
    path.write_text(json.dumps(config))
    raw = path.read_bytes()
    man = json.loads((ckpt_dir / "manifest.json").read_text())
    man["files"]["config.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (ckpt_dir / "manifest.json").write_text(json.dumps(man))


def test_a_checkpoint_saved_flat_resumes_and_generates(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from hla_sp.launch import checkpoint
    from hla_sp.launch.export import generate
    from hla_sp.launch.train.main import run

    tiny = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--seed", "5", "--lr-decay-iters", "4"]
    save = str(tmp_path / "c")
    run(parse_args([*tiny, "--train-iters", "2", "--save", save]), exit_on_error=False)
    d = Path(checkpoint.iter_dir(save, 2))
    cfg = TrainConfig.from_dict(json.loads((d / "config.json").read_text()))
    _rewrite_config(d, cfg.flat())  # as an earlier version wrote it: flat keys
    assert not isinstance(json.loads((d / "config.json").read_text())["data"], dict)
    loaded, it = generate.load_config(save)
    assert (loaded, it) == (cfg, 2)
    recs = run(parse_args([*tiny, "--train-iters", "3", "--load", save]), exit_on_error=False)
    assert [r["iteration"] for r in recs] == [3]
