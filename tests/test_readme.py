"""The README and the docs site stay true: the methods reference is generated from the registry, the Quick start
loop is one text in both places, every documented `atorch.x` exists, and the site builds with no broken link."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atorch.cli import main, methods_markdown

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _block(path: Path, marker: str) -> str:
    match = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", path.read_text(encoding="utf-8"), re.S)
    assert match, f"{path.relative_to(ROOT)} lost its <!-- {marker}:start/end --> markers"
    return match.group(1)


def test_methods_page_matches_registry() -> None:
    assert _block(DOCS / "methods.md", "methods") == methods_markdown(), (
        "docs/methods.md's methods section is stale: paste `atorch methods --markdown` between its markers")


def test_layout_page_lists_every_module() -> None:
    """docs/layout.md's module tree is generated from the package (scripts/layout_doc.py): a module added, moved
    or removed without regenerating it fails here."""
    spec = importlib.util.spec_from_file_location("layout_doc", ROOT / "scripts" / "layout_doc.py")
    layout_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout_doc)
    assert _block(DOCS / "layout.md", "modules") == layout_doc.module_tree(), (
        "docs/layout.md's module tree is stale: run python scripts/layout_doc.py")


def test_docs_quick_start_loop_is_the_tested_readme_loop() -> None:
    """tests/test_readme_loop.py runs the README's block; the docs page must show that same text."""
    assert _block(DOCS / "getting-started.md", "loop") == _block(README, "loop")


def test_readme_links_point_to_existing_files() -> None:
    """mkdocs checks the links inside docs/; the README's relative links (into docs/) are checked here."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    relative = [t for t in targets if "://" not in t]
    assert relative, "the README links to no docs page"
    missing = [t for t in relative if not (ROOT / t).is_file()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_cli_check_reports_problems(capsys) -> None:
    assert main(["check", '["zero1", "fsdp"]', "--world-size", "2"]) == 1
    assert "'zero1' cannot be combined with 'fsdp'" in capsys.readouterr().err
    assert main(["check", '["parallel_mode", "fsdp"]', "--world-size", "2"]) == 0
    assert '"data",\n            2' in capsys.readouterr().out


def test_every_atorch_name_the_docs_mention_exists() -> None:
    """A documented `atorch.x.y` that does not import or resolve is a broken promise to a user."""
    import importlib

    docs = [README, *sorted(DOCS.glob("**/*.md")), ROOT / "examples" / "vit" / "README.md"]
    assert len(docs) > 10, docs
    names = sorted({m for doc in docs for m in re.findall(r"`(atorch(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", doc.read_text())})
    assert "atorch.train_step" in names and len(names) > 15, names  # the docs pages are scanned too
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


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the docs extra)")
def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link or anchor, a page missing from the nav or an API entry that no longer resolves fails here."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
               "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()
