"""The module tree of docs/layout.md, generated from each module's docstring (its first sentence), so the page
lists every module the package has and no module it lost.

    python scripts/layout_doc.py          # rewrite the block between docs/layout.md's modules markers
    python scripts/layout_doc.py --check  # exit 1 when the block is stale (tests/test_readme.py checks it too)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "atorch"
PAGE = ROOT / "docs" / "layout.md"
MARKERS = ("<!-- modules:start -->\n", "\n<!-- modules:end -->")


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring, on one line (an empty docstring is a defect the caller names)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", paragraph)[0]


def module_tree(package: Path = PACKAGE) -> str:
    """Every module and subpackage under ``package``, depth first, each with its docstring's first sentence."""
    lines: list[str] = []

    def walk(directory: Path, depth: int) -> None:
        for path in sorted(directory.iterdir(), key=lambda p: (p.is_dir(), p.name)):
            if path.is_dir() and (path / "__init__.py").exists():
                lines.append(f"{'  ' * depth}- `{path.name}/`: {first_sentence(path / '__init__.py')}")
                walk(path, depth + 1)
            elif path.suffix == ".py" and path.name != "__init__.py":
                lines.append(f"{'  ' * depth}- `{path.name}`: {first_sentence(path)}")

    walk(package, 0)
    missing = [line for line in lines if line.endswith(": ")]
    if missing:
        raise ValueError(f"modules without a docstring (their first sentence is the layout's entry): {missing}")
    return "\n".join(lines)


def with_tree(page: str, tree: str) -> str:
    start, end = page.index(MARKERS[0]) + len(MARKERS[0]), page.index(MARKERS[1])
    return page[:start] + tree + page[end:]


def main() -> int:
    page = PAGE.read_text(encoding="utf-8")
    fresh = with_tree(page, module_tree())
    if "--check" in sys.argv[1:]:
        if fresh != page:
            print("docs/layout.md's module tree is stale: run python scripts/layout_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
