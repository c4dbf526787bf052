#!/usr/bin/env bash
# Install k3post (and its test tools) into the current Python environment.
# torch: the CPU build 2.13.0 when torch is missing (pyproject keeps torch as a range for GPU users).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[dev,distributed,visual,web]'  # distributed: Ray, so CI runs tests/test_ray.py; visual: matplotlib + Pillow (general.visual); web: Pillow (coding.webdev's screenshots)
# bubblewrap for the code sandbox, and chromium + chromium-driver + python3-selenium for coding.webdev: fails the
# install where apt-get exists but cannot provide them (skipped with a warning where apt-get is unavailable)
bash scripts/install_sandbox.sh
