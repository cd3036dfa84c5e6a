#!/usr/bin/env bash
# Set up everything on a fresh machine, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
python -m ruff check .
lint-imports  # the layers and no import circles: pyproject.toml [tool.importlinter]
python -m pytest -q --durations=15 "$@"
