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


def test_every_command_and_argument_has_help_text() -> None:
    """`atorch CMD --help` opens with what the command does, and every argument says what it is."""
    import argparse

    from atorch import cli

    built: dict[str, argparse.ArgumentParser] = {}
    original = argparse.ArgumentParser.parse_args

    def keep(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built["parser"] = self
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = keep  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            cli.main(["methods"])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    if not sub.description:
                        missing.append(f"{name} {command}: no description")
                    walk(sub, f"{name} {command}")
            elif action.help is None:
                missing.append(f"{name} {action.dest}")

    walk(built["parser"], "atorch")
    assert not missing, missing
