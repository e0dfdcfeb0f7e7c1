"""Checkpoint files are digested on save and verified on load: a flipped byte, a
truncated file, a ``model_optim/`` or a manifest from another iteration is refused in
one line naming the file, by a resume (``checkpoint.load``) and by ``generate``
(``checkpoint.load_weights``) alike; a checkpoint without a manifest is refused unless
its format predates manifests (then one warning); on several ranks every rank refuses together."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_formats import without_manifest_as_format_2
from hla_sp.launch import checkpoint
from hla_sp.launch.checkpoint import manifest


def _parts(fill: float = 0.0) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    if fill:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    opt = torch.optim.AdamW(model.parameters())
    return dict(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def _save(root: Path, it: int, fill: float = 0.0, **kw: object) -> Path:
    return Path(checkpoint.save(str(root), it, rank=0, world_size=1, tp_rank=0,
                                writes_model=True, consumed_samples=it, config={},
                                **_parts(fill), **kw))  # type: ignore[arg-type]  # fmt: skip


def _load(root: Path, step: int | None = None) -> torch.nn.Module:
    parts = _parts(-1.0)
    checkpoint.load(str(root), rank=0, world_size=1, tp_rank=0, step=step, **parts)
    return parts["model"]


def _refusals(root: Path, it: int) -> list[str]:
    """The messages of a resume and of a weights-only load of iteration ``it``."""
    out = []
    for read in (lambda: _load(root, it),
                 lambda: checkpoint.load_weights(str(root), it, _parts()["model"])):
        with pytest.raises(checkpoint.CheckpointError) as e:
            read()
        out.append(str(e.value))
    return out


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


def test_save_lists_every_file_with_its_digest_and_iteration(tmp_path: Path,
                                                             group: None) -> None:
    d = _save(tmp_path / "c", 3, fill=0.5)
    body = json.loads((d / checkpoint.MANIFEST).read_text())
    assert body["iteration"] == 3 and body["algorithm"] == "sha256" and body["finite"] is True
    on_disk = sorted(str(p.relative_to(d)) for p in d.rglob("*")
                     if p.is_file() and p.name != checkpoint.MANIFEST)  # fmt: skip
    assert sorted(body["files"]) == on_disk
    assert {"common.pt", "config.json", "model_optim/.metadata", "model_optim/__0_0.distcp",
            "rng_rank00000.pt"} <= set(on_disk)
    for name, entry in body["files"].items():
        raw = (d / name).read_bytes()
        assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    # verified and loaded as written
    assert float(_load(tmp_path / "c")[0].weight[0, 0].detach()) == 0.5


def test_flipped_byte_in_a_shard_is_refused_naming_the_file(tmp_path: Path,
                                                            group: None) -> None:
    root = tmp_path / "c"
    d = _save(root, 2, fill=0.25)
    shard = d / "model_optim" / "__0_0.distcp"
    for at in (None, shard.stat().st_size - 3):  # the middle, and a tensor's last bytes
        _flip(shard, at)
        for msg in _refusals(root, 2):
            assert msg.startswith(f"{shard}: sha256 "), msg
            assert "\n" not in msg and "manifest.json of iteration 2 records" in msg
            assert "--ckpt-step" in msg
        _flip(shard, at)  # back: loads again
        _load(root, 2)


def test_model_optim_or_manifest_from_another_iteration_is_refused(tmp_path: Path,
                                                                   group: None) -> None:
    root = tmp_path / "c"
    _save(root, 1, fill=1.0)
    d2 = _save(root, 2, fill=2.0)
    shutil.rmtree(d2 / "model_optim")
    shutil.copytree(root / "iter_0000001" / "model_optim", d2 / "model_optim")
    for msg in _refusals(root, 2):
        assert msg.startswith(f"{d2 / 'model_optim'}{os.sep}") and "sha256" in msg, msg
    shutil.copy(root / "iter_0000001" / checkpoint.MANIFEST, d2 / checkpoint.MANIFEST)
    for msg in _refusals(root, 2):
        assert msg.startswith(f"{d2 / checkpoint.MANIFEST}: records iteration 1, expected 2")


def test_truncated_or_missing_file_is_refused(tmp_path: Path, group: None) -> None:
    root = tmp_path / "c"
    d = _save(root, 4)
    rng = d / "rng_rank00000.pt"
    size = rng.stat().st_size
    rng.write_bytes(rng.read_bytes()[:100])
    for msg in _refusals(root, 4):
        assert msg.startswith(f"{rng}: 100 bytes, manifest.json of iteration 4 records {size}")
    rng.unlink()
    for msg in _refusals(root, 4):
        assert msg.startswith(f"{rng}: missing; manifest.json of iteration 4 lists it")


def test_a_deleted_manifest_is_refused_unless_the_format_predates_manifests(
    tmp_path: Path, group: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probe 5: a deleted manifest.json turned verification off ("written before files
    were digested", false), and a resume then certified the corrupt file."""
    monkeypatch.setattr(checkpoint.layout, "_warned", set())
    root = tmp_path / "c"
    d = _save(root, 5, fill=0.75)
    (d / checkpoint.MANIFEST).unlink()
    for msg in _refusals(root, 5):
        assert msg.startswith(f"{d}: no manifest.json, though its format always writes one "
                              f"(common.pt records format 3 or later): it was deleted or "
                              f"lost"), msg
    from hla_sp.launch.checkpoint import manifest as m

    with m.unverified():  # hla-sp export --no-verify
        assert float(_load(root)[0].weight[0, 0].detach()) == 0.75
    assert capsys.readouterr().err.strip().splitlines() == [
        f"[hla-sp] warning: {d}: no manifest.json (--no-verify); loading it unverified"]
    without_manifest_as_format_2(d)  # written before manifests existed: loads, with one warning
    assert float(_load(root)[0].weight[0, 0].detach()) == 0.75
    model = _parts()["model"]
    checkpoint.load_weights(str(root), 5, model)
    assert float(model[0].weight[0, 0].detach()) == 0.75
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[hla-sp] warning: {d}: no manifest.json (written before files were "
                   f"digested: common.pt records format 2; manifests came with format 3); "
                   f"loading it unverified"], err


def test_common_pt_of_another_iteration_is_refused_without_a_manifest(
    tmp_path: Path, group: None
) -> None:
    root = tmp_path / "c"
    _save(root, 1)
    d2 = _save(root, 2)
    shutil.copy(root / "iter_0000001" / "common.pt", d2 / "common.pt")
    without_manifest_as_format_2(d2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        _load(root, 2)
    assert str(e.value).startswith(f"{d2 / 'common.pt'}: records iteration 1, expected 2")


def _verify_on(rank: int, world_size: int, d: str, it: int) -> str:
    try:
        manifest.verify(d, it)
    except checkpoint.CheckpointError as e:
        return str(e)
    return "ok"


def test_every_rank_refuses_when_one_rank_finds_the_bad_file(
    tmp_path: Path, group: None, world: object
) -> None:
    """Each rank digests a share of the files; a mismatch in rank 1's share is raised
    on rank 0 too, which would otherwise go on into DCP's collective read alone."""
    d = _save(tmp_path / "c", 6)
    files = json.loads((d / checkpoint.MANIFEST).read_text())["files"]
    names = sorted(files)
    names.sort(key=lambda n: -files[n]["size"])
    assert _verify_on(0, 1, str(d), 6) == "ok"
    bad = d / names[1]  # rank 1's first file of 2
    _flip(bad)
    got = world(2).run(_verify_on, str(d), 6)  # type: ignore[operator]
    assert got[0] == got[1] and got[0].startswith(f"{bad}: sha256 "), got


def test_resume_of_a_corrupt_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    """The issue's case end to end: one flipped byte in a shard, resumed under torchrun
    (2 ranks): one line naming the shard, from the run, and a non-zero exit."""
    from hla_sp.launch.config.train_config import parse_args
    from hla_sp.launch.distributed.local import run_local
    from hla_sp.launch.train.main import run

    tiny = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--lr", "3e-3", "--seed", "7", "--micro-batch-size", "2"]
    ck = tmp_path / "ck"
    run(parse_args([*tiny, "--train-iters", "2", "--save", str(ck)]), exit_on_error=False)
    shard = ck / "iter_0000002" / "model_optim" / "__0_0.distcp"
    _flip(shard)
    out = run_local([*tiny, "--context-parallel-size", "2", "--train-iters", "4",
                     "--load", str(ck), "--save", str(ck), "--use-checkpoint-opt_param-scheduler"],
                    2, str(tmp_path / "m.jsonl"),
                    timeout=300)  # fmt: skip
    assert out.returncode != 0 and out.records == [], out.output[-3000:]
    lines = [x for x in out.output.splitlines() if "sha256" in x]
    assert len(lines) == 1 and lines[0].startswith(f"hla-sp train: error: {shard}: sha256 "), \
        out.output[-3000:]
