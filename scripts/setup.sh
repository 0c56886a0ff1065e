#!/usr/bin/env bash
# Creates .venv (once) and installs tilewise into it, editable; `setup.sh dev` adds the test extra.
# TILEWISE_TORCH picks the torch to install when the venv has none (default: torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${TILEWISE_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${1:+[$1]}"
