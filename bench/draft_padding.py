"""Benchmark: EAGLE-3 draft training with length-bucketed batches (``draft.length_bucket``) against random
batches (``length_bucket: 1``): seconds per step, padded positions, and held-out acceptance.

    python bench/draft_padding.py [--sft-steps 100] [--n-per-family 4] [--steps 60] [--bucket 8] [--repeats 3]
        [--bucketed-steps 90]

Setup: the demo-size target (bench/draft.py's ``build_target``: the demo preset, briefly SFT-trained on
arithmetic), draft data as the demo makes it (`target_generations` over every default family at efforts low, high,
max, ``--n-per-family`` tasks each, ``--max-tokens`` a turn, temperature 1) and held-out episodes of another seed.
For each repeat, two drafts from the same start (``Eagle3Draft.from_target``, stock aux layers) train for
``--steps`` steps on the same samples with the same seed, one with ``length_bucket`` 1 and one with ``--bucket``,
in alternating order (load from other processes hits both alike). Timed: `train_draft` alone (no data
generation, no evaluation). Printed: the ratio of medians (random / bucketed seconds: > 1 means bucketing is
faster) with paired min-max, the padded share of the positions each arm trained on, and α per depth on the
held-out episodes (`evaluate_alpha`) for each arm. Caveat: bucketing changes which samples share a batch, so the
two drafts differ (same samples, same number of steps); α is reported to show it does not suffer, over
``--repeats`` draft seeds. The last line is JSON (``speedup``, ``padding_random``, ``padding_bucketed``,
``alpha0_*``, ``machine``). ``--bucketed-steps`` gives the bucketed arm more steps (about equal time when
scaled by the speed-up): then ``speedup`` is the ratio of the arms' times for unequal work, labelled so.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_state, ratio_summary  # noqa: E402
from draft import build_target  # noqa: E402

from k3post.config.draft import DraftConfig  # noqa: E402
from k3post.envs.families import default_families  # noqa: E402
from k3post.rollout import EmbeddedEngine  # noqa: E402
from k3post.spec.data import target_generations  # noqa: E402
from k3post.spec.eagle3 import Eagle3Draft, stock_aux_layers  # noqa: E402
from k3post.spec.train import evaluate_alpha, step_batch, train_draft  # noqa: E402
from k3post.xtml import XTML  # noqa: E402


def padding_share(lengths: list[int], cfg: DraftConfig, seed: int) -> float:
    """Padded share of the positions the ``cfg.steps`` batches of `train_draft` hold (`step_batch`)."""
    pad = total = 0
    for s in range(cfg.steps):
        b = step_batch(lengths, cfg.batch_size, cfg.length_bucket, seed, s)
        T = max(lengths[i] for i in b)
        total += T * len(b)
        pad += sum(T - lengths[i] for i in b)
    return pad / total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--n-per-family", type=int, default=4)
    ap.add_argument("--held-per-family", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--bucket", type=int, default=8)
    ap.add_argument("--bucketed-steps", type=int, default=0,
                    help="steps of the bucketed arm (default --steps): e.g. 1.5x --steps compares at about equal time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=DraftConfig.batch_size, help="episodes per draft step")
    ap.add_argument("--ttt-steps", type=int, default=DraftConfig.ttt_steps, help="unrolled training-time-test steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target, tok = build_target(work, args.sft_steps, seed=0)
        xtml = XTML(tok)
        fams = [f.name for f in default_families()]
        gen = EmbeddedEngine(target, tok, max_batch_size=32, seed=0)
        train = target_generations(gen, xtml, fams, n_per_family=args.n_per_family, efforts=["low", "high", "max"],
                                   max_tokens=args.max_tokens, seed=0)
        held = target_generations(gen, xtml, fams, n_per_family=args.held_per_family, efforts=["low", "max"],
                                  max_tokens=args.max_tokens, seed=9_999)
        pad = tok.pad_token_id
        base = DraftConfig(steps=args.steps, batch_size=args.batch_size, ttt_steps=args.ttt_steps, progress=False,
                           save_every=10**9, log_every=args.steps)
        lengths = [min(len(s.ids), base.max_len) for s in train]
        print(f"families {fams}; {len(train)} training episodes (mean {statistics.mean(lengths):.0f} tokens, max "
              f"{max(lengths)}), {len(held)} held-out; setup {time.perf_counter() - t0:.0f} s", flush=True)
        arms = {"random": replace(base, length_bucket=1),
                "bucketed": replace(base, length_bucket=args.bucket, steps=args.bucketed_steps or args.steps,
                                    log_every=args.bucketed_steps or args.steps)}
        times: dict[str, list[float]] = {k: [] for k in arms}
        alpha: dict[str, list[list[float]]] = {k: [] for k in arms}
        aux = stock_aux_layers(target.config.num_hidden_layers)
        for r in range(args.repeats):
            for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                draft = Eagle3Draft.from_target(target, aux)
                t = time.perf_counter()
                train_draft(target, draft, train, arms[name], work / f"{name}-{r}", pad_id=pad, seed=r, resume=False)
                times[name].append(time.perf_counter() - t)
                alpha[name].append(evaluate_alpha(target, draft, held, arms[name], pad)["t1"])
                print(f"repeat {r} {name}: {times[name][-1]:.1f} s, held-out α by depth "
                      f"{[round(a, 3) for a in alpha[name][-1]]}", flush=True)
    out: dict[str, Any] = ratio_summary("speedup", times["random"], times["bucketed"])
    for name, cfg in arms.items():
        out[f"padding_{name}"] = round(statistics.mean(padding_share(lengths, cfg, r) for r in range(args.repeats)), 3)
        out[f"seconds_{name}"] = [round(t, 1) for t in times[name]]
        for d in (0, len(alpha[name][0]) - 1):
            out[f"alpha{d}_{name}"] = round(statistics.mean(a[d] for a in alpha[name]), 4)
    steps_note = f" ({arms['bucketed'].steps} bucketed steps vs {args.steps}: unequal work)" if args.bucketed_steps else ""
    print(f"bucketed (length_bucket {args.bucket}) vs random batches{steps_note}: {out['speedup']:.2f}x faster (paired "
          f"{out['speedup_min']:.2f}-{out['speedup_max']:.2f}, {args.repeats} repeats); padded positions "
          f"{out['padding_random']:.0%} -> {out['padding_bucketed']:.0%}; held-out α depth 0 {out['alpha0_random']} -> "
          f"{out['alpha0_bucketed']}")
    print(json.dumps({**out, "setup": vars(args), "machine": machine_state()}))


if __name__ == "__main__":
    main()
