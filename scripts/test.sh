#!/usr/bin/env bash
# Set up .venv, then run the test suite (Triton kernels run in the interpreter on CPU-only machines).
# Extra arguments go to pytest (e.g. -m gpu on a GPU machine, -k attention).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
