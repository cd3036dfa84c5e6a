"""The ATorch and Colossal-AI examples of the docs run as written.

A fenced ``python`` block right after ``<!-- snippet: 1 process -->`` or ``<!-- snippet: 2 processes -->``
in any page under docs/ is an example that must run at the size it is written: one torchrun launch per
process count runs every such block (tests/workers/snippet_worker.py), each in a fresh namespace.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from launcher import HERE, run_json

DOCS = HERE.parent / "docs"
WORKER = HERE / "workers" / "snippet_worker.py"
MARKED = re.compile(r"<!-- snippet: (\d) process(?:es)? -->\n```python\n(.*?)\n```", re.S)


def snippets() -> dict[int, dict[str, str]]:
    """Process count -> {"page.md:line": source}."""
    found: dict[int, dict[str, str]] = {}
    for page in sorted(DOCS.glob("**/*.md")):
        text = page.read_text(encoding="utf-8")
        for match in MARKED.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(int(match.group(1)), {})[f"{page.relative_to(DOCS)}:{line}"] = match.group(2)
    return found


SNIPPETS = snippets()
NAMES = [(nproc, name) for nproc, named in sorted(SNIPPETS.items()) for name in named]


def test_the_differences_page_has_examples_of_both_apis() -> None:
    on_page = [name for _, name in NAMES if name.startswith("differences.md:")]
    assert len(on_page) >= 4, on_page
    text = (DOCS / "differences.md").read_text(encoding="utf-8")
    assert text.count("<!-- snippet:") == len(on_page), "a marker not followed by a ```python block"
    assert "## Differences from ATorch" in text and "## Differences from Colossal-AI" in text


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for nproc, named in SNIPPETS.items():
        work = tmp_path_factory.mktemp(f"snippets{nproc}")
        source = work / "snippets.json"
        source.write_text(json.dumps(named), encoding="utf-8")
        out[nproc] = run_json(WORKER, str(source), str(work), nproc=nproc, timeout=300)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(650)
@pytest.mark.parametrize(("nproc", "name"), NAMES, ids=[f"{name}[{nproc}]" for nproc, name in NAMES])
def test_documented_example_runs(reports: dict[int, dict[str, Any]], nproc: int, name: str) -> None:
    entry = reports[nproc][name]
    assert "error" not in entry, f"{name} ({nproc} process(es)) failed: {entry['error']}"
