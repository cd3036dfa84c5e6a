"""Whether ``pip install -e ".[EXTRA]"`` has nothing left to do for this checkout (scripts/demo.sh runs it).

Usage: ``python scripts/install_check.py EXTRA`` in the checkout's root. Exit status 0, printing nothing, when
atorch imports from this checkout, its installed metadata declares the requirements that setup.cfg declares now
(the core ones and EXTRA's; a requirement added to setup.cfg since the install makes them differ), and every one
of them is installed at a version it allows. Otherwise exit status 1 and one line saying what is missing.
"""

from __future__ import annotations

import configparser
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip carries its own copy; the demo runs pip anyway
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def _key(req: Requirement) -> tuple[str, frozenset[str], str]:
    return canonicalize_name(req.name), frozenset(req.extras), str(req.specifier)


def declared(root: Path, extra: str) -> list[Requirement]:
    """The core requirements and EXTRA's, as setup.cfg lists them."""
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg", encoding="utf-8")
    extras = config["options.extras_require"]
    if extra not in extras:
        raise SystemExit(f"setup.cfg has no extra {extra!r} (it has: {', '.join(extras)})")
    lines = config["options"].get("install_requires", "").splitlines() + extras[extra].splitlines()
    return [Requirement(line) for line in (raw.split("#")[0].strip() for raw in lines) if line]


def installed(extra: str) -> list[Requirement] | None:
    """The core requirements and EXTRA's, as the installed atorch's metadata lists them (None: not installed)."""
    try:
        requires = metadata.distribution("atorch").requires or []
    except metadata.PackageNotFoundError:
        return None
    reqs = [Requirement(text) for text in requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]


def problem(root: Path, extra: str) -> str | None:
    """What pip would have to do, in a few words; None when nothing."""
    spec = importlib.util.find_spec("atorch")
    if spec is None or spec.origin is None:
        return "atorch is not installed"
    here = (root / "atorch").resolve()
    if Path(spec.origin).resolve().parent != here:
        return f"atorch imports from {Path(spec.origin).parent}, not from this checkout ({here})"
    wanted, have = declared(root, extra), installed(extra)
    if have is None:
        return "atorch is not installed with pip"
    if {_key(r) for r in wanted} != {_key(r) for r in have}:
        return "setup.cfg's requirements changed since atorch was installed"
    for req in wanted:
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} is installed, {req} is required"
    return None


if __name__ == "__main__":
    reason = problem(Path.cwd(), sys.argv[1] if len(sys.argv) > 1 else "demo")
    if reason:
        print(reason)
    sys.exit(1 if reason else 0)
