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


def test_every_atorch_name_the_docs_mention_exists() -> None:
    """A documented `atorch.x.y` that does not import or resolve is a broken promise to a user."""
    import importlib

    docs = [README, README.parent / "examples" / "vit" / "README.md"]
    names = sorted({m for doc in docs for m in re.findall(r"`(atorch(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", doc.read_text())})
    assert "atorch.train_step" in names
    missing = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
    assert not missing, missing
