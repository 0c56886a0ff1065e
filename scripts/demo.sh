#!/usr/bin/env bash
# Quick start: set up .venv, then train the tiny preset on the Python standard library's source.
# Extra arguments go to `tilewise train` (e.g. --preset gpt2-124m, --set train.max_steps=200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tilewise train "$@"
