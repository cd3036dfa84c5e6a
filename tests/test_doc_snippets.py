"""Every code block of README.md and docs/*.md runs as written, or says why not.

The blocks come from the Markdown itself (tests/doc_blocks.py explains the markers), so a doc change that breaks
one fails here:

- a ``python`` block without a marker fails ``test_every_python_block_is_marked``;
- every snippet runs at its process count, after the setup blocks it names, with one torchrun launch per process
  count (tests/workers/snippet_worker.py); examples naming the strategy server's documented address
  (``http://127.0.0.1:8765``, the port of the ``atorch serve`` line) run against a real ``atorch serve`` that this
  test starts on 127.0.0.1, at a free port: that address, and only it, is replaced by the server's;
- in ``bash`` blocks, every ``atorch`` command runs (``serve``, which would not return, is parsed with
  ``--help``), every ``pip install -e ".[extra]"`` names an extra of setup.cfg, and every script exists.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
from typing import Any

import pytest
from doc_blocks import ROOT, blocks, chain, problems
from launcher import HERE, run_json

from atorch.cli import main as atorch_cli

WORKER = HERE / "workers" / "snippet_worker.py"
DOCUMENTED_SERVER = "http://127.0.0.1:8765"
BLOCKS = blocks()
SNIPPETS = [b for b in BLOCKS if b.kind == "snippet"]
NAMES = [(b.nproc, b.where) for b in SNIPPETS]


def test_every_python_block_is_marked() -> None:
    found = problems(BLOCKS)
    assert not found, "\n".join(found)
    assert len(SNIPPETS) >= 15, [b.where for b in SNIPPETS]
    assert {b.page for b in SNIPPETS} >= {"README.md", "docs/getting-started.md", "docs/automatic.md",
                                          "docs/server.md", "docs/lightning.md", "docs/booster.md"}


def test_an_unmarked_block_fails(tmp_path) -> None:
    """The check itself: a page with an unmarked python block, a bad count and an unknown setup is refused."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n<!-- snippet: two processes -->\n```python\ny = 2\n```\n\n"
                    "<!-- snippet: 1 process, after: nothing -->\n```python\nz = 3\n```\n", encoding="utf-8")
    import doc_blocks

    monkey = pytest.MonkeyPatch()
    monkey.setattr(doc_blocks, "ROOT", tmp_path)
    try:
        found = problems(blocks([page]))
    finally:
        monkey.undo()
    assert any("page.md:1: a python block without a marker" in p for p in found), found
    assert any("'snippet: two processes' is not 'N process(es)'" in p for p in found), found
    assert any("after: 'nothing' names no block" in p for p in found), found


def test_the_differences_page_has_examples_of_both_apis() -> None:
    on_page = [b for b in SNIPPETS if b.page == "docs/differences.md"]
    assert len(on_page) >= 4, [b.where for b in on_page]
    text = (ROOT / "docs" / "differences.md").read_text(encoding="utf-8")
    assert "## Differences from ATorch" in text and "## Differences from Colossal-AI" in text


# ----- bash blocks ----------------------------------------------------------------------------------------------
def _commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv) of every command in the bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in BLOCKS:
        if block.lang not in ("bash", "sh", "shell", "console"):
            continue
        for offset, line in enumerate(block.source.replace("\\\n", " ").splitlines()):
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):  # VAR=value cmd
                        command.pop(0)
                    if command:
                        out.append((f"{block.page}:{block.line + 1 + offset}", command))
                    command = []
                else:
                    command.append(word)
    return out


COMMANDS = _commands()


def test_documented_atorch_commands_run(tmp_path, monkeypatch, capsys) -> None:
    """In page order in one directory: `atorch plan ... --emit-strategy strategy.json`, then `atorch check` of it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path / "cache"))
    ran = []
    for where, argv in COMMANDS:
        if argv[0] != "atorch":
            continue
        args = [a.replace("$HOME", str(tmp_path)) for a in argv[1:]]
        if args[0] == "serve":  # serves until stopped: check that the line parses
            with pytest.raises(SystemExit) as stop:
                atorch_cli([*args, "--help"])
            assert stop.value.code == 0, f"{where}: {shlex.join(argv)} does not parse"
        else:
            assert atorch_cli(args) == 0, f"{where}: {shlex.join(argv)} failed:\n{capsys.readouterr()}"
        ran.append(args[0])
    assert {"serve", "plan", "check"} <= set(ran), ran


def test_documented_pip_extras_and_scripts_exist() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = set(config["options.extras_require"])
    texts = [p.read_text(encoding="utf-8") for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))]
    named = {extra for text in texts for group in re.findall(r'pip install [^`\n]*?-e "\.\[([^\]]+)\]"', text)
             for extra in group.split(",")}
    assert {"server", "docs", "booster", "lightning"} <= named, named
    assert named <= extras, f"pip extras the docs name that setup.cfg lacks: {sorted(named - extras)}"
    scripts = [(where, argv[1]) for where, argv in COMMANDS if argv[0] == "bash"]
    scripts += [(where, argv[argv.index("-f") + 1]) for where, argv in COMMANDS if argv[:2] == ["docker", "build"]]
    assert scripts, COMMANDS
    missing = [f"{where}: {path}" for where, path in scripts if not (ROOT / path).is_file()]
    assert not missing, missing


def test_the_documented_server_address_is_the_serve_lines() -> None:
    serve = [argv for _, argv in COMMANDS if argv[:2] == ["atorch", "serve"] and "--port" in argv]
    assert serve and all(argv[argv.index("--port") + 1] == DOCUMENTED_SERVER.rsplit(":", 1)[1] for argv in serve)


# ----- python snippets ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from server_harness import ProcessServer

    needs_server = any(DOCUMENTED_SERVER in b.source for b in SNIPPETS)
    server = None
    out: dict[int, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as monkey:
        cache = tmp_path_factory.mktemp("snippet-cache")
        monkey.setenv("ATORCH_CACHE_DIR", str(cache))  # fresh searches; the user's cache untouched
        try:
            if needs_server:
                server = ProcessServer(f"sqlite:///{cache}/server.db").start()
            for nproc in sorted({b.nproc for b in SNIPPETS}):
                work = tmp_path_factory.mktemp(f"snippets{nproc}")
                named = {}
                for block in (b for b in SNIPPETS if b.nproc == nproc):
                    steps = [[b.where, b.source] for b in chain(block, BLOCKS)]
                    if server is not None:
                        steps = [[where, source.replace(DOCUMENTED_SERVER, server.url)] for where, source in steps]
                    named[block.where] = steps
                source = work / "snippets.json"
                source.write_text(json.dumps(named), encoding="utf-8")
                out[nproc] = run_json(WORKER, str(source), str(work), nproc=nproc, timeout=420)
                for name, entry in out[nproc].items():  # shown with pytest -s: where the time goes
                    print(f"{nproc} process(es) {name}: {entry.get('seconds', 'failed')} s")
            if server is not None:
                import httpx

                names = httpx.get(f"{server.url}/v1/studies", timeout=30).json()
                out[0] = {"server_trials": {name: len(httpx.get(f"{server.url}/v1/studies/{name}/trials",
                                                                timeout=30).json()) for name in names}}
        finally:
            if server is not None:
                server.kill()
    return out


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nproc", "name"), NAMES, ids=[f"{name}[{nproc}]" for nproc, name in NAMES])
def test_documented_example_runs(reports: dict[int, dict[str, Any]], nproc: int, name: str) -> None:
    entry = reports[nproc][name]
    assert "error" not in entry, f"{name} ({nproc} process(es)) failed: {entry['error']}"


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_server_examples_used_the_server(reports: dict[int, dict[str, Any]]) -> None:
    """The strategy-server examples searched through the server the harness started, not locally."""
    trials = reports[0]["server_trials"]
    assert trials and all(count >= 1 for count in trials.values()), trials
