"""Benchmark: EAGLE-3 drafts trained with LK_α, LK_λ and KL (SPEC §6.2, §7: LK +1% acceptance length at
temperature 0, +4–8% at temperature 1), measured by speculative decoding in the embedded engine.

Setup: the demo-size target (``build_tiny_moe(vocab, "tiny")``: hidden 128, 4 layers, 8 experts, a 512-token
BPE), briefly SFT-trained on the ``general.arithmetic`` reference solutions (``--sft-steps``) so it is not
uniform; or ``--target DIR`` (a saved model + tokenizer folder). Draft data: the target's own episodes at
temperature 1 (``target_generations``), ``--train-tasks`` training tasks and ``--held-tasks`` held-out ones
(another seed), at efforts low and max. For each of ``--seeds`` seeds, three drafts
(``Eagle3Draft.from_target`` with the default aux ids ``stock_aux_layers(L)`` = (1, L//2, L−1), the same init for
the three) are trained with the SAME samples, steps, batch order and seed, differing only in ``draft.loss`` (kl,
lk_alpha, lk_lambda); the batches each draft saw are hashed (``data_sha``) so the equality is checked, not assumed.

Measured on the held-out episodes: α per depth (``evaluate_alpha``: mean Σ min(p, q) at temperature 1,
teacher forced); the acceptance length (tokens per target forward and row, bonus included:
``spec_acceptance_length``) of real speculative decoding with an ``Eagle3Drafter`` on the held-out prompts at
k = 3, 5, 7 and temperature 0 and 1 (``--gen-tokens`` tokens at most; the EOM stop ends a reply).
``lk_over_kl_accept_len_t1``: per seed LK_α / KL acceptance length at T = 1, k = 5; the mean over seeds with a
95% t-interval (n - 1 degrees of freedom).

Timing (``speed_grid``, with the seed-0 LK_α draft): decode tokens/s of speculative vs plain decoding of the same
requests (the first ``batch`` held-out prompts, ``ignore_eos``, ``--gen-tokens`` each), median of ``--repeats``
interleaved rounds, over batch 1 and 8 × temperature 1 and 0 × k 2, 3, 5 (``speed_grid`` in the JSON, each
cell with its acceptance length, the draft's seconds per forward and the target's per verify round over a plain
decode step). Headline ``spec_decode_speedup``: batch 1, k = 3, temperature 1 (speculative decoding is a
latency technique: at batch 1 a verify forward of k + 1 positions costs about one decode step; at batch 8 on a
CPU it costs ~2.4, since the work is compute-bound there). Excluded from timing: the admission / prefill step,
model, tokenizer and engine construction, SFT, data generation and draft training. One torch thread, lean path.

Defaults took about 13 minutes on a shared 2-core CPU (docs/decisions.md; ``--draft-steps 50`` or
``--seeds 2`` brings it under 10); scale with ``--sft-steps --train-tasks --held-tasks
--draft-steps --seeds --gen-tokens``. Caveats: a ~1 M-parameter target trained for seconds, a CPU, a few seeds:
the ratio is this setting's, not the paper's.

Run: ``python bench/draft.py [--target DIR] [--seeds 3] [--draft-steps 80] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary  # noqa: E402

import k3post.spec.train as spec_train  # noqa: E402
from k3post.config.draft import DRAFT_LOSSES, DraftConfig  # noqa: E402
from k3post.config.sft import SFTConfig  # noqa: E402
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams  # noqa: E402
from k3post.rollout.speculative import SpeculativeConfig  # noqa: E402
from k3post.spec.data import DraftSample, target_generations  # noqa: E402
from k3post.spec.drafter import Eagle3Drafter  # noqa: E402
from k3post.spec.eagle3 import Eagle3Draft, stock_aux_layers  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

FAMILY = "general.arithmetic"
KS = (3, 5, 7)
TEMPERATURES = (0.0, 1.0)
LOSSES = ("kl", "lk_alpha", "lk_lambda")
assert set(LOSSES) == set(DRAFT_LOSSES)

_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086]


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table to 20, then the Cornish–Fisher
    expansion z + (z³+z)/4df + (5z⁵+16z³+3z)/96df², within 1e-3)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci95(xs: list[float]) -> dict[str, float]:
    """Mean and its 95% t-interval over independent runs (half-width t_{.975, n-1} · sd / √n; nan for n = 1)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "lo": float("nan"), "hi": float("nan"), "n": len(xs)}
    h = t_quantile_975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": m, "lo": m - h, "hi": m + h, "n": len(xs)}


@contextmanager
def _batch_hashes(out: list[str]) -> Iterator[None]:
    """Record a hash of every batch ``train_draft`` builds (its ids and masks), in order."""
    real = spec_train.draft_batch

    def hashed(samples: Any, max_len: int, pad_id: int) -> Any:
        ids, sampled, real_mask = real(samples, max_len, pad_id)
        out.append(hashlib.sha256(ids.numpy().tobytes() + sampled.numpy().tobytes()
                                  + real_mask.numpy().tobytes()).hexdigest())
        return ids, sampled, real_mask

    spec_train.draft_batch = hashed
    try:
        yield
    finally:
        spec_train.draft_batch = real


def build_target(work: Path, sft_steps: int, seed: int, layers: int = 0) -> tuple[torch.nn.Module, Any]:
    """The demo-size tiny MoE with a fresh tokenizer (``k3post.recipes.commands.init_model``), SFT-trained for
    ``sft_steps`` on the arithmetic family's reference solutions; ``layers`` > 0 gives it that many decoder
    layers instead of the preset's 4 (same width, same seed)."""
    from k3post.recipes.commands import init_model
    from k3post.data import load_sft_jsonl
    from k3post.io import write_jsonl
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families import EFFORTS, get_family
    from k3post.models import build_tiny_moe, load_model
    from k3post.stages.sft import train_sft
    from k3post.tokenizer import load_tokenizer

    init_model(work / "init", seed=seed)
    tok, model = load_tokenizer(work / "init"), load_model(work / "init")
    if layers:
        model = build_tiny_moe(len(tok), seed=seed, num_hidden_layers=layers, pad_token_id=tok.pad_token_id,
                               eos_token_id=model.config.eos_token_id)
    fam = get_family(FAMILY)
    recs = []
    for i, task in enumerate(fam.generate(200, seed=seed)):
        effort = EFFORTS[i % len(EFFORTS)]
        ep = run_episode_sync(fam.reference_policy(task, effort), fam.make_env(task), task)
        recs.append({"messages": ep.messages, "tools": None, "effort": effort})
    samples, _ = load_sft_jsonl(write_jsonl(work / "sft.jsonl", recs), XTML(tok), max_len=1024)
    if sft_steps > 0:
        cfg = SFTConfig(steps=sft_steps, rows_per_batch=8, pack_len=256, warmup_steps=min(10, sft_steps),
                        lr=5e-3, save_every=10 ** 9, progress=False)
        train_sft(model, tok, samples, cfg, work / "sft", seed=seed)
    return model.eval(), tok


def draft_data(target: torch.nn.Module, tok: Any, args: argparse.Namespace) -> tuple[list[DraftSample], list[DraftSample]]:
    """(train, held-out) draft data: the target's own episodes at temperature 1 on ``FAMILY``, efforts low and max,
    ``args.train_tasks`` / ``args.held_tasks`` tasks (another task seed for the held-out ones)."""
    xtml = XTML(tok)
    gen = EmbeddedEngine(target, tok, max_batch_size=32, seed=args.seed)
    train = target_generations(gen, xtml, [FAMILY], n_per_family=args.train_tasks, efforts=["low", "max"],
                               max_tokens=args.data_tokens, seed=args.seed)
    held = target_generations(gen, xtml, [FAMILY], n_per_family=args.held_tasks, efforts=["low", "max"],
                              max_tokens=args.data_tokens, seed=args.seed + 9_999)
    return train, held


def _prompt(s: DraftSample) -> list[int]:
    """An episode's prompt: its ids up to the first token the target sampled."""
    return s.ids[: s.mask.index(True)] if True in s.mask else s.ids


class TimedDrafter(Eagle3Drafter):
    """An Eagle3Drafter that adds up the seconds spent in ``propose``."""

    seconds = 0.0

    def propose(self, rows, k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return super().propose(rows, k)
        finally:
            self.seconds += time.perf_counter() - t0


def decode_seconds(engine: EmbeddedEngine, reqs: list[GenerationRequest]) -> tuple[float, dict[str, list[int]], int]:
    """(seconds of the decode steps, output ids by request, decode steps) of one run: the admission step (the
    prefill) is run first and not timed."""
    for r in reqs:
        engine.add_request(r)
    engine.step()
    out: dict[str, list[int]] = {}
    seconds, steps = 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        done = engine.step()
        seconds += time.perf_counter() - t0
        steps += 1
        out.update({d.request_id: d.output_ids for d in done})
    return seconds, out, steps


def accept_length(target: torch.nn.Module, tok: Any, draft: Eagle3Draft, prompts: list[list[int]], k: int,
                  temperature: float, max_tokens: int) -> float:
    """``spec_acceptance_length`` of speculative decoding with ``draft`` over the held-out prompts."""
    engine = EmbeddedEngine(target, tok, max_batch_size=len(prompts), path="lean",
                            speculative=SpeculativeConfig(Eagle3Drafter(draft, target), k))
    engine.generate([GenerationRequest(f"h{i}", p, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                                  seed=1000 + i)) for i, p in enumerate(prompts)])
    return float(engine.stats["spec_acceptance_length"])


SPEED_GRID = tuple((b, k, t) for b in (1, 8) for t in (1.0, 0.0) for k in (2, 3, 5))
"""(batch, k, temperature) cells of ``speed_grid``; the headline ``spec_decode_speedup`` is (1, 3, 1.0)."""


def speed_grid(target: torch.nn.Module, tok: Any, draft: Eagle3Draft, prompts: list[list[int]], max_tokens: int,
               repeats: int, grid: tuple[tuple[int, int, float], ...] = SPEED_GRID) -> dict[str, Any]:
    """Speculative (``draft``) vs plain decode tokens/s of the same requests (``ignore_eos``, exactly
    ``max_tokens`` each, the first ``batch`` prompts, seeds 0 …) per (batch, k, temperature) cell, median of
    ``repeats`` interleaved rounds (module docstring for what is excluded). Per cell: the speedup with its
    paired min / max, the acceptance length, whether the tokens equal plain decoding's (temperature 0), the
    draft's seconds per forward and the target's per verify round, both over a plain decode step."""
    cells: dict[str, Any] = {}
    for batch, k, temp in grid:
        reqs = [GenerationRequest(f"s{i}", p, SamplingParams(temperature=temp, max_tokens=max_tokens,
                                                             ignore_eos=True, seed=i))
                for i, p in enumerate(prompts[:batch])]
        last: dict[str, Any] = {}

        def plain() -> float:
            engine = EmbeddedEngine(target, tok, max_batch_size=len(reqs), path="lean")
            seconds, last["plain_ids"], steps = decode_seconds(engine, reqs)
            last["plain_step_s"] = seconds / steps
            return seconds / engine.stats["decode_tokens"]

        def spec() -> float:
            drafter = TimedDrafter(draft, target)
            engine = EmbeddedEngine(target, tok, max_batch_size=len(reqs), path="lean",
                                    speculative=SpeculativeConfig(drafter, k))
            seconds, last["spec_ids"], _ = decode_seconds(engine, reqs)
            last["draft_forward_s"] = drafter.seconds / max(1, drafter.forwards)
            last["verify_round_s"] = (seconds - drafter.seconds) / engine.stats["spec_target_forwards"]
            last["accept_len"] = engine.stats["spec_acceptance_length"]
            return seconds / engine.stats["decode_tokens"]

        times = interleaved({"plain": plain, "spec": spec}, repeats=repeats, warmup=1)
        r = ratio_summary("speedup", times["plain"], times["spec"])  # seconds per token: plain / spec
        cells[f"b{batch}_k{k}_t{temp:g}"] = {
            "speedup": r["speedup"], "min": r["speedup_min"], "max": r["speedup_max"],
            "accept_len": last["accept_len"],
            "draft_forward_over_decode_step": last["draft_forward_s"] / last["plain_step_s"],
            "verify_round_over_decode_step": last["verify_round_s"] / last["plain_step_s"],
            "plain_tokens_per_s": 1 / statistics.median(times["plain"]),
            "same_tokens": last["plain_ids"] == last["spec_ids"] if temp == 0 else None,
        }
    head = cells.get("b1_k3_t1") or next(iter(cells.values()))
    return {"spec_decode_speedup": head["speedup"], "spec_decode_speedup_min": head["min"],
            "spec_decode_speedup_max": head["max"], "draft_cost_vs_target": head["draft_forward_over_decode_step"],
            "grid": cells}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The whole benchmark (module docstring); returns the final JSON record."""
    torch.set_num_threads(1)
    if args.target:
        from k3post.models import load_model
        from k3post.tokenizer import load_tokenizer

        target, tok = load_model(args.target).eval(), load_tokenizer(args.target)
    else:
        target, tok = build_target(work, args.sft_steps, args.seed)
    train, held = draft_data(target, tok, args)
    prompts = [_prompt(s) for s in held]
    L = len(target.model.layers)
    aux = stock_aux_layers(L)  # what `k3post draft` trains by default (stock vLLM / SGLang serve it)
    base = DraftConfig(steps=args.draft_steps, batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                       warmup_steps=min(10, args.draft_steps), save_every=10 ** 9, log_every=10 ** 9, progress=False)
    pad = tok.pad_token_id
    rows: list[dict[str, Any]] = []
    drafts: dict[tuple[int, str], Eagle3Draft] = {}
    for s in range(args.seeds):
        for loss in LOSSES:
            cfg = replace(base, loss=loss)
            torch.manual_seed(s)
            draft = Eagle3Draft.from_target(target, aux)
            hashes: list[str] = []
            t0 = time.perf_counter()
            with _batch_hashes(hashes):
                spec_train.train_draft(target, draft, train, cfg, work / f"draft-{s}-{loss}", pad_id=pad, seed=s,
                                       resume=False)
            train_s = time.perf_counter() - t0
            alpha = spec_train.evaluate_alpha(target, draft, held, cfg, pad)["t1"]  # Σ min(p, q), T = 1
            acc = {f"k{k}_t{t:g}": accept_length(target, tok, draft, prompts, k, t, args.gen_tokens)
                   for k in KS for t in TEMPERATURES}
            rows.append({"seed": s, "loss": loss, "alpha_by_depth": alpha, "accept_len": acc, "train_s": train_s,
                         "data_sha": hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]})
            drafts[s, loss] = draft
            print(f"seed {s} {loss:9s} α {' '.join(f'{a:.3f}' for a in alpha)}  accept len "
                  + " ".join(f"{k}={v:.3f}" for k, v in acc.items()), file=sys.stderr, flush=True)
    by = {(r["seed"], r["loss"]): r for r in rows}

    def ratios(num: str, key: str) -> dict[str, Any]:
        per_seed = [by[s, num]["accept_len"][key] / by[s, "kl"]["accept_len"][key] for s in range(args.seeds)]
        return {**mean_ci95(per_seed), "per_seed": per_seed}

    timing = speed_grid(target, tok, drafts[0, "lk_alpha"], prompts, args.gen_tokens, args.repeats,
                        SPEED_GRID if args.speed_grid == "full" else ((1, 3, 1.0),))
    return {
        "lk_over_kl_accept_len_t1": ratios("lk_alpha", "k5_t1"),
        "lk_lambda_over_kl_accept_len_t1": ratios("lk_lambda", "k5_t1"),
        "lk_over_kl_accept_len_t0": ratios("lk_alpha", "k5_t0"),
        "lk_lambda_over_kl_accept_len_t0": ratios("lk_lambda", "k5_t0"),
        "alpha_by_depth": {loss: [statistics.fmean(by[s, loss]["alpha_by_depth"][i] for s in range(args.seeds))
                                  for i in range(args.ttt_steps)] for loss in LOSSES},
        "accept_len": {loss: {key: statistics.fmean(by[s, loss]["accept_len"][key] for s in range(args.seeds))
                              for key in rows[0]["accept_len"]} for loss in LOSSES},
        "spec_decode_speedup": timing["spec_decode_speedup"],
        "spec_decode_speedup_min": timing["spec_decode_speedup_min"],
        "spec_decode_speedup_max": timing["spec_decode_speedup_max"],
        "draft_cost_vs_target": timing["draft_cost_vs_target"],
        "speed_grid": timing["grid"],
        "same_data": all(len({by[s, loss]["data_sha"] for loss in LOSSES}) == 1 for s in range(args.seeds)),
        "runs": rows,
        "setup": {**vars(args), "aux_layers": list(aux), "train_samples": len(train), "held_samples": len(held),
                  "excluded_from_timing": "admission / prefill step, model / tokenizer / engine construction, SFT, "
                                          "data generation, draft training"},
    }


def table(res: dict[str, Any]) -> str:
    """Mean over seeds per loss: α per depth and acceptance length per (k, T)."""
    keys = list(next(iter(res["accept_len"].values())))
    depth = len(next(iter(res["alpha_by_depth"].values())))
    head = "| loss | " + " | ".join(f"α{i}" for i in range(depth)) + " | " + " | ".join(
        f"len {k.replace('_', ' ')}" for k in keys) + " |"
    lines = [head, "|" + "---|" * (1 + depth + len(keys))]
    for loss in LOSSES:
        lines.append(f"| {loss} | " + " | ".join(f"{a:.3f}" for a in res["alpha_by_depth"][loss]) + " | "
                     + " | ".join(f"{res['accept_len'][loss][k]:.3f}" for k in keys) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="", help="a saved model + tokenizer folder (default: build and SFT one)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="target, data and tokenizer seed")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--train-tasks", type=int, default=48, help="training tasks (x2 efforts episodes)")
    ap.add_argument("--held-tasks", type=int, default=8, help="held-out tasks (x2 efforts episodes)")
    ap.add_argument("--data-tokens", type=int, default=96, help="max tokens per turn of the draft data")
    ap.add_argument("--draft-steps", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--speed-grid", choices=("full", "headline"), default="full",
                    help="full: batch 1 and 8 x T 1 and 0 x k 2, 3, 5; headline: batch 1, k 3, T 1 only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="folder for the work files (default: a temporary one)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        res = run(args, Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as d:
            res = run(args, Path(d))
    print(table(res))
    print(json.dumps({"machine": machine_state(), "runs": res["runs"], "setup": res["setup"]}, default=float))
    print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "setup")}, default=float))


if __name__ == "__main__":
    main()
