"""Benchmark: where speculative decoding pays on this CPU. Speculative vs plain decoding with a trained EAGLE-3
draft, for targets of the demo width at several depths.

Speculative decoding pays when a draft forward costs a small fraction of a target decode step and a verify
forward of k + 1 positions costs about one step. A one-layer EAGLE-3 draft against the demo target (4 layers)
costs about half a decode step on this CPU (every op is per-call overhead at width 128); against deeper targets
of the same width its share shrinks as 1/L, as it does for real targets (K3: 61 layers). So for each depth L in
``--layers``, the same recipe as bench/draft.py:

    target   bench/draft.build_target: the demo-width tiny MoE with L layers, SFT on general.arithmetic
             (``--sft-steps``, the same data and seed at every depth)
    data     the target's own episodes at temperature 1 (``--train-tasks`` / ``--held-tasks`` tasks x 2 efforts)
    draft    one LK_α draft, the default aux ids (1, L//2, L−1), ``--draft-steps`` steps (DraftConfig as bench/draft.py)
    timing   bench/draft.speed_grid on the held-out prompts: batch 1 and 8 x temperature 1 and 0 x k 2, 3, 5,
             decode tokens/s of speculative vs plain decoding, median of ``--repeats`` interleaved rounds

Excluded from timing: the admission / prefill step, model / tokenizer / engine construction, SFT, data and
draft training. One torch thread, lean engine path. Final JSON line: ``spec_decode_speedup_L{L}`` (batch 1,
k 3, T 1) and the best cell per depth, with every cell's numbers in ``grid_L{L}``. Caveats: ~1-3 M-parameter
targets trained for a minute or two, one seed, a shared 2-core CPU; the acceptance lengths are those targets'.

Run: ``python bench/spec_decode.py [--layers 4,12] [--sft-steps 150] [--draft-steps 80] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_state  # noqa: E402
from draft import SPEED_GRID, _prompt, build_target, draft_data, speed_grid  # noqa: E402

import k3post.spec.train as spec_train  # noqa: E402
from k3post.config.draft import DraftConfig  # noqa: E402
from k3post.models import count_parameters  # noqa: E402
from k3post.spec.eagle3 import Eagle3Draft, stock_aux_layers  # noqa: E402


def one_depth(args: argparse.Namespace, layers: int, work: Path) -> dict[str, Any]:
    """Target, data, LK_α draft and the speed grid at one depth (module docstring)."""
    t0 = time.perf_counter()
    target, tok = build_target(work, args.sft_steps, args.seed, layers)
    train, held = draft_data(target, tok, args)
    cfg = DraftConfig(loss="lk_alpha", steps=args.draft_steps, batch_size=8, lr=3e-3, ttt_steps=7,
                      warmup_steps=min(10, args.draft_steps), save_every=10 ** 9, log_every=10 ** 9, progress=False)
    torch.manual_seed(args.seed)
    draft = Eagle3Draft.from_target(target, stock_aux_layers(layers))
    spec_train.train_draft(target, draft, train, cfg, work / "draft", pad_id=tok.pad_token_id, seed=args.seed,
                           resume=False)
    setup_s = time.perf_counter() - t0
    grid = SPEED_GRID if args.grid == "full" else ((1, 3, 1.0),)
    timing = speed_grid(target, tok, draft.eval(), [_prompt(s) for s in held], args.gen_tokens, args.repeats, grid)
    best_key = max(timing["grid"], key=lambda c: timing["grid"][c]["speedup"])
    return {"layers": layers, "target_params": count_parameters(target), "draft_params":
            count_parameters(draft) - draft.embed_tokens.weight.numel(), "setup_s": setup_s, **timing,
            "best_cell": best_key}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for layers in [int(x) for x in args.layers.split(",")]:
        res = one_depth(args, layers, work / f"L{layers}")
        grid = res.pop("grid")
        print(f"L={layers}: " + "  ".join(f"{c} {v['speedup']:.2f}x (len {v['accept_len']:.2f})"
                                          for c, v in grid.items()), file=sys.stderr, flush=True)
        out[f"spec_decode_speedup_L{layers}"] = res["spec_decode_speedup"]
        out[f"best_L{layers}"] = {"cell": res["best_cell"], **grid[res["best_cell"]]}
        out[f"grid_L{layers}"] = grid
        out[f"setup_L{layers}"] = res
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,12", help="target depths, comma-separated (4 = the demo target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--train-tasks", type=int, default=48)
    ap.add_argument("--held-tasks", type=int, default=8)
    ap.add_argument("--data-tokens", type=int, default=96)
    ap.add_argument("--draft-steps", type=int, default=80)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grid", choices=("full", "headline"), default="full")
    ap.add_argument("--out", default="", help="folder for the work files (default: a temporary one)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.out:
        res = run(args, Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as d:
            res = run(args, Path(d))
    print(json.dumps({"machine": machine_state(), "setup": vars(args)}))
    print(json.dumps(res, default=float))


if __name__ == "__main__":
    main()
