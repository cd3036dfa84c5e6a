#!/usr/bin/env bash
# Set up everything on a fresh machine, then train a transformers GPT-2 on 2 processes with a strategy.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[demo]"
python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29533}" \
    examples/train_gpt2.py "$@"
