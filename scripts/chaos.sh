#!/usr/bin/env bash
# Kill -9 anywhere, lose nothing (issue 20): SFT, RL (paused trajectories + KV pool), MOPD, synth and review
# are each SIGKILLed at >= 5 seeded random moments, resumed, and compared with an uninterrupted run
# (bench/chaos.py). Stops by itself: bench/chaos.py's --budget-s (default 1800 s) and a hard timeout here.
#   bash scripts/chaos.sh                     # all stages, 5 kills each, seed 0
#   bash scripts/chaos.sh --kills 8 --seed 3 --stages sft,rl
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=KILL 2400 python bench/chaos.py --kills 5 "$@"
