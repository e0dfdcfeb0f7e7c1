"""A user's operator against the second pass of probes: ``register()`` compares it with
its own reference (fp64, a small input) and refuses the built-in mixers' names; each
checkpoint records the SHA-256 of its source, and a reader warns in one line when it
changed; a module that calls ``sys.exit`` at import is one line, not a silent end."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from hla_sp.launch import checkpoint
from test_custom_import import USER_MODULE

from hla_sp.ops import operators


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("qqv", "softmax"):
        if name in operators.TABLE:
            operators.unregister(name)
    for m in ("qqv_checked", "qqv_wrong", "exits_at_import"):
        sys.modules.pop(m, None)


def test_register_checks_the_operator_against_its_reference(user_dir: Path) -> None:
    """Probe 9: register() never compared an operator with its own reference."""
    wrong = USER_MODULE.replace("out.append(torch.einsum(\"bhk,bhkv->bhv\", qs[:, t], Hs))",
                                "out.append(1.01 * torch.einsum(\"bhk,bhkv->bhv\", qs[:, t], Hs))")
    assert wrong != USER_MODULE
    (user_dir / "qqv_wrong.py").write_text(wrong)
    with pytest.raises(ValueError) as e:
        importlib.import_module("qqv_wrong")
    assert str(e.value).startswith("spec.reference: operator 'qqv''s stages differ from its "
                                   "reference by 9.9"), str(e.value)
    assert "qqv" not in operators.TABLE  # nothing registered
    (user_dir / "qqv_checked.py").write_text(USER_MODULE)
    importlib.import_module("qqv_checked")  # the right one registers
    assert "qqv" in operators.TABLE


def test_built_in_mixer_names_are_refused(user_dir: Path) -> None:
    """Low: a module could register the name softmax, which can never be selected."""
    (user_dir / "qqv_checked.py").write_text(USER_MODULE)
    mod = importlib.import_module("qqv_checked")
    operators.unregister("qqv")
    for name in ("softmax", "hla2"):
        spec = operators.OperatorSpec(name, mod.QQVState, operators.TABLE["hla2"].fields[:0],
                                      mod.qqv_stages, public=mod.qqv,
                                      reference=mod.qqv_reference)
        with pytest.raises(ValueError, match=f"name: expected a new operator name, got "
                                             f"'{name}'.*'softmax'"):
            operators.register(spec)


def test_a_module_exiting_at_import_is_one_line(user_dir: Path) -> None:
    """Low: a module calling sys.exit(3) at import ended the command silently."""
    from hla_sp.megatron_patch.args import import_custom

    (user_dir / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError) as e:
        import_custom(["exits_at_import"])
    assert str(e.value) == ("--custom-import exits_at_import: the module called sys.exit(3) "
                            "while being imported; a module that registers operators must "
                            "not exit")


def test_a_changed_operator_source_is_a_one_line_warning(
    user_dir: Path, group: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probe 9: the run recorded the operator by module name only; after its maths
    changed, the same checkpoint silently gave other logits."""
    monkeypatch.setattr(checkpoint.layout, "_warned", set())
    src = user_dir / "qqv_checked.py"
    src.write_text(USER_MODULE)
    importlib.import_module("qqv_checked")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    root = user_dir / "ck"
    checkpoint.save(str(root), 1, rank=0, world_size=1, tp_rank=0, writes_model=True,
                    model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                    consumed_samples=1, config={})  # fmt: skip
    checkpoint.load_weights(str(root), 1, model)
    assert capsys.readouterr().err == ""  # unchanged: nothing said
    src.write_text(USER_MODULE.replace("gam * Hs + k", "gam * Hs + 2 * k"))
    checkpoint.load_weights(str(root), 1, model)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"[hla-sp] warning: {root / 'iter_0000001'}: operator 'qqv' (qqv_checked) changed "
        f"since the checkpoint was saved (source sha256 "), err
    assert err[0].endswith("its outputs may differ from the training run's")
