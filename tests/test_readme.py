"""The README's methods reference is generated from the registry; this keeps it current."""

from __future__ import annotations

import re
from pathlib import Path

from atorch.cli import main, methods_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_methods_section_matches_registry() -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- methods:start -->\n(.*?)\n<!-- methods:end -->", text, re.S)
    assert match, "README.md lost its <!-- methods:start/end --> markers"
    assert match.group(1) == methods_markdown(), "README methods section is stale: run `atorch methods --markdown`"


def test_cli_check_reports_problems(capsys) -> None:
    assert main(["check", '["zero1", "fsdp"]', "--world-size", "2"]) == 1
    assert "'zero1' cannot be combined with 'fsdp'" in capsys.readouterr().err
    assert main(["check", '["parallel_mode", "fsdp"]', "--world-size", "2"]) == 0
    assert '"data",\n            2' in capsys.readouterr().out
