#!/usr/bin/env bash
# Set up everything on a fresh machine (once), then train a transformers GPT-2 on 2 processes with a strategy.
# The arguments go to examples/train_gpt2.py (none: the strategy is found by the automatic search).
# pip runs only when scripts/install_check.py finds something to do: atorch not installed from this checkout,
# a requirement of atorch[demo] missing or at a version setup.cfg does not allow, or setup.cfg changed since.
# PYTHON names the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
say() { printf '==> %s\n' "$*"; }

if reason=$("$PYTHON" scripts/install_check.py demo); then
    say "atorch is installed from this checkout with its dependencies: nothing to install"
else
    say "installing atorch and its dependencies (${reason}; first run: a few minutes)..."
    "$PYTHON" -m pip install --disable-pip-version-check --progress-bar off -e ".[demo]"
    say "installed"
fi

if [[ " $* " == *" --strategy "* || " $* " == *" --strategy="* ]]; then
    say "training a GPT-2 on 2 processes with the given strategy..."
else
    say "searching a strategy for a GPT-2 on 2 processes (a second run takes it from the search's cache), then training it..."
fi
"$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29533}" \
    examples/train_gpt2.py "$@"
