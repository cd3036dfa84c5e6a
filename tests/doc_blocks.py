"""The code blocks of README.md and docs/*.md, with the marker that says how each one is tested.

Every fenced ``python`` block carries one marker, an HTML comment on a line of its own right above it (other
comments, such as ``<!-- loop:start -->``, may sit between the marker and the fence):

- ``<!-- snippet: N process(es) -->``: runs as written, in a fresh namespace, on N processes.
- ``<!-- snippet: N process(es), after: NAME -->``: runs in the namespace left by the block named NAME (and by
  the blocks that one runs after), as a reader who typed them one after the other has it.
- ``, name: NAME`` on a snippet lets later snippets run after it.
- ``<!-- setup: NAME -->`` (optionally ``, after: NAME``): objects the examples use (a model, a dataset, a
  loss), shown on the page; it runs in front of every snippet that names it, never alone.
- ``<!-- fragment: why -->``: a partial that does not run by itself; the reason is said in the marker.

Blocks of a page run in page order (README.md first, then docs/ by name), in one working directory per process
count, so a file an earlier block writes (``strategy.json``) is there for a later one, as in a reader's session.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
COMMENT = re.compile(r"^<!--\s*(.*?)\s*-->$")
SNIPPET = re.compile(r"(\d+) process(?:es)?$")


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    source: str
    kind: str | None = None  # "snippet", "setup", "fragment"; None: no marker
    nproc: int = 0
    name: str | None = None
    after: str | None = None
    reason: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _parse_marker(block: Block, text: str) -> None:
    head, _, rest = text.partition(":")
    head, rest = head.strip(), rest.strip()
    if head == "fragment":
        block.kind, block.reason = "fragment", rest
        if not rest:
            block.problems.append("a fragment marker must say why the block does not run")
        return
    parts = [p.strip() for p in rest.split(",")]
    block.kind = head
    if head == "setup":
        block.name = parts[0]
    else:
        count = SNIPPET.fullmatch(parts[0])
        if count is None:
            block.problems.append(f"'snippet: {parts[0]}' is not 'N process(es)'")
        else:
            block.nproc = int(count.group(1))
    for part in parts[1:]:
        key, _, value = part.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("after", "name") and value:
            setattr(block, key, value)
        else:
            block.problems.append(f"unknown marker option {part!r} (after: NAME, name: NAME)")


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every fenced block of the pages, with its marker read."""
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            block = Block(str(page.relative_to(ROOT)), line, match.group(1), match.group(2))
            above = text[:match.start()].rstrip("\n").split("\n")
            while above and COMMENT.match(above[-1].strip()):
                comment = COMMENT.match(above.pop().strip()).group(1)
                if comment.split(":")[0].strip() in ("snippet", "setup", "fragment"):
                    if block.kind is not None:
                        block.problems.append("two markers")
                    _parse_marker(block, comment)
            found.append(block)
    return found


def problems(all_blocks: list[Block]) -> list[str]:
    """What is wrong with the markers: a python block without one, a name used twice or never defined, ..."""
    out = []
    named: dict[str, Block] = {}
    for block in all_blocks:
        out += [f"{block.where}: {p}" for p in block.problems]
        if block.lang == "python" and block.kind is None:
            out.append(f"{block.where}: a python block without a marker (<!-- snippet: N process(es) -->, "
                       "<!-- setup: NAME -->, or <!-- fragment: why -->); see tests/doc_blocks.py")
        if block.lang != "python" and block.kind is not None:
            out.append(f"{block.where}: a marker on a {block.lang or 'plain'} block")
        if block.name:
            if block.name in named:
                out.append(f"{block.where}: the name {block.name!r} is also {named[block.name].where}'s")
            named[block.name] = block
    for block in all_blocks:
        if block.after and block.after not in named:
            out.append(f"{block.where}: after: {block.after!r} names no block")
    used = {b.after for b in all_blocks if b.after}
    out += [f"{b.where}: the setup {b.name!r} is used by no snippet" for b in all_blocks
            if b.kind == "setup" and b.name not in used]
    return out


def chain(block: Block, all_blocks: list[Block]) -> list[Block]:
    """The blocks to run for ``block``, first to last: its setups, then itself."""
    named = {b.name: b for b in all_blocks if b.name}
    out = [block]
    while out[0].after:
        before = named[out[0].after]
        if before in out:
            raise ValueError(f"{block.where}: a cycle of after: names")
        out.insert(0, before)
    return out
