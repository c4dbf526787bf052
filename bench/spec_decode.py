"""Benchmark: speculative decoding against plain decoding in the embedded engine, same target and requests.

Setup: the demo's tiny Qwen3-MoE target (``build_tiny_moe(512)``, preset "tiny": hidden 128, 4 layers, 8
experts, ~1.05 M parameters) and a drafter 4x smaller (hidden 64, 2 layers, 2 heads, expert width 64,
~0.26 M parameters, another seed), both freshly initialised (no checkpoint is trained here, so the
acceptance is that of two random models: near-uniform distributions at temperature 1 overlap a lot, and a
tied-embedding random model's argmax tends to repeat its input at temperature 0; a trained target with a
trained drafter gives other numbers). ``--requests`` requests of ``--prompt-len`` random tokens sample
exactly ``--new-tokens`` tokens each (``ignore_eos``), all in one batch, lean path, one torch thread.

Timed: the decode steps only (every step after the admission step, whose prefill is excluded on both
arms; model construction and the engine's set-up are excluded too). Reported: decode tokens/s of each arm
(median over ``--repeats`` interleaved rounds), ``spec_decode_speedup`` = speculative / plain tokens/s,
the acceptance rate (accepted / drafted) and length (tokens per target forward and row, bonus included),
and the drafter's cost: seconds in ``ModelDrafter.propose`` per draft forward over seconds per plain
target decode forward. The tokens differ between the arms at temperature 1 (other random streams, same
law); at temperature 0 they are checked equal.

Run: ``python bench/spec_decode.py [--requests 8 --prompt-len 32 --new-tokens 64 --k 4 --temperature 1]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary  # noqa: E402

from k3post.models import build_tiny_moe, count_parameters  # noqa: E402
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams  # noqa: E402
from k3post.rollout.speculative import ModelDrafter, SpeculativeConfig  # noqa: E402

DRAFTER_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32, moe_intermediate_size=64)


class TimedPropose:
    """Mixin for a Drafter class: adds up the seconds spent in ``propose`` (``class T(TimedPropose, ModelDrafter)``)."""

    seconds = 0.0

    def propose(self, rows, k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return super().propose(rows, k)
        finally:
            self.seconds += time.perf_counter() - t0


class _TimedDrafter(TimedPropose, ModelDrafter):
    """A ModelDrafter that adds up the seconds spent in ``propose``."""


def _decode(engine: EmbeddedEngine, reqs: list[GenerationRequest]) -> tuple[float, dict[str, list[int]], int]:
    """(seconds of the decode steps, output ids by request, decode steps) of one run."""
    for r in reqs:
        engine.add_request(r)
    engine.step()  # admission (prefill): excluded
    out: dict[str, list[int]] = {}
    seconds, steps = 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        done = engine.step()
        seconds += time.perf_counter() - t0
        steps += 1
        out.update({d.request_id: d.output_ids for d in done})
    return seconds, out, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = build_tiny_moe(512, seed=0).eval()
    draft = build_tiny_moe(512, seed=1, **DRAFTER_SHAPE).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(f"r{i}", torch.randint(5, 512, (args.prompt_len,), generator=g).tolist(),
                              SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens,
                                             ignore_eos=True, seed=i)) for i in range(args.requests)]
    n_tokens = args.requests * (args.new_tokens - 1)  # the first token of a plain run comes with the prefill
    last: dict[str, object] = {}

    def plain() -> float:
        engine = EmbeddedEngine(target, max_batch_size=args.requests, max_model_len=1024, path="lean")
        seconds, last["plain_ids"], last["plain_steps"] = _decode(engine, reqs)
        last["plain_tps"] = engine.stats["decode_tokens"] / seconds
        last["plain_step_s"] = seconds / last["plain_steps"]  # type: ignore[operator]
        return seconds / engine.stats["decode_tokens"] * n_tokens

    def spec() -> float:
        drafter = _TimedDrafter(draft)
        engine = EmbeddedEngine(target, max_batch_size=args.requests, max_model_len=1024, path="lean",
                                speculative=SpeculativeConfig(drafter, args.k))
        seconds, last["spec_ids"], _ = _decode(engine, reqs)
        last["spec_tps"] = engine.stats["decode_tokens"] / seconds
        last["stats"] = {k: v for k, v in engine.stats.items() if k.startswith("spec_")}
        last["draft_forward_s"] = drafter.seconds / max(1, drafter.forwards)
        last["target_verify_s"] = (seconds - drafter.seconds) / engine.stats["spec_target_forwards"]
        return seconds / engine.stats["decode_tokens"] * n_tokens

    times = interleaved({"plain": plain, "spec": spec}, repeats=args.repeats, warmup=1)
    speed = ratio_summary("spec_decode_speedup", times["plain"], times["spec"])
    st = last["stats"]
    out = {
        "machine": machine_state(),
        "setup": vars(args) | {"target_params": count_parameters(target), "drafter_params": count_parameters(draft),
                               "excluded": "admission / prefill step, model and engine construction"},
        "plain_decode_tokens_per_s": round(float(last["plain_tps"]), 1),  # type: ignore[arg-type]
        "spec_decode_tokens_per_s": round(float(last["spec_tps"]), 1),  # type: ignore[arg-type]
        "target_verify_forward_s": last["target_verify_s"], "plain_decode_forward_s": last["plain_step_s"],
        "same_tokens": last["plain_ids"] == last["spec_ids"],
    }
    print(json.dumps(out, indent=1))
    print(json.dumps({
        **{k: round(v, 3) for k, v in speed.items()},
        "acceptance_rate": round(float(st["spec_acceptance_rate"]), 3),  # type: ignore[index]
        "acceptance_length": round(float(st["spec_acceptance_length"]), 3),  # type: ignore[index]
        "drafter_cost_per_target_forward": round(float(last["draft_forward_s"]) / float(last["plain_step_s"]), 3),  # type: ignore[arg-type]
        "k": args.k, "temperature": args.temperature,
    }))


if __name__ == "__main__":
    main()
