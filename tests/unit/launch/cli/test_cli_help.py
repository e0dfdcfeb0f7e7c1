"""``hla-sp --help`` and every command's help read as plain text: no reST markup."""

from __future__ import annotations

import re

import pytest
from hla_sp.launch.cli import commands as cli

MARKUP = re.compile(r"``|:\w+:`")


@pytest.mark.parametrize("cmd", ["", "train", "sweep", "make-dataset", "generate", "export",
                                 "eval"])
def test_help_is_plain_text(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [cmd, "--help"] if cmd else ["--help"]
    try:
        assert cli.main(argv) == 0
    except SystemExit as e:  # argparse's --help
        assert e.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and not MARKUP.search(out), MARKUP.findall(out)
