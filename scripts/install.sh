#!/usr/bin/env bash
# Install k3post (and its test tools) into the current Python environment.
# torch: the CPU build 2.13.0 when torch is missing (pyproject keeps torch as a range for GPU users).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[dev]'
# bubblewrap for the code sandbox (skipped with a warning where apt is unavailable)
if [ -f scripts/install_sandbox.sh ]; then bash scripts/install_sandbox.sh || echo "warning: sandbox setup failed; the sandbox falls back to weaker isolation" >&2; fi
