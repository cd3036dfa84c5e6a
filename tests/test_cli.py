"""The ``atorch`` command line's own options."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

import atorch
from atorch.cli import main


def test_version_prints_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"atorch {atorch.__version__}\n"
    # the distribution's version is read from atorch.__version__, so the two cannot differ
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: atorch.__version__"
