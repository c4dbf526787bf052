"""Benchmark: the embedded engine's lean path against its general path on the same model and requests.

Setup: the tiny Qwen3-MoE of the demo (``build_tiny_moe``, preset "tiny": hidden 128, 4 layers, 8
experts), vocabulary 512, fp32; ``--requests`` requests of ``--prompt-len`` random tokens, each sampling
exactly ``--new-tokens`` tokens (``ignore_eos``; with ``--ragged`` prompt i is ``i`` tokens longer), at most ``--requests`` slots, one torch thread. Each
round runs ``EmbeddedEngine(model, path=...).generate`` for both paths (order alternating); the engine's
own step timer is not used: decode tokens/s = decode tokens / seconds spent in steps that only decode
(every step after the first, since all requests are admitted together). Reports the median over
``--repeats`` rounds, the ratio lean / general, the KV bytes each path holds at the end, and checks that
both paths sampled the same tokens.

Run: ``python bench/engine_paths.py [--requests 16 --prompt-len 32 --new-tokens 64 --repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3post.models import build_tiny_moe
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams


def _run(model: torch.nn.Module, reqs: list[GenerationRequest], path: str) -> tuple[float, list[list[int]], int]:
    """(decode tokens/s, sampled ids per request, KV bytes held after the last decode step)."""
    engine = EmbeddedEngine(model, max_batch_size=len(reqs), max_model_len=1024, path=path)
    for r in reqs:
        engine.add_request(r)
    engine.step()  # admission: prefill + first token of every request
    done, decode_s, kv_bytes = {}, 0.0, 0
    while engine.has_unfinished():
        kv_bytes = engine.cache.nbytes
        t0 = time.perf_counter()
        out = engine.step()
        decode_s += time.perf_counter() - t0
        done.update({o.request_id: o.output_ids for o in out})
    return engine.stats["decode_tokens"] / decode_s, [done[r.request_id] for r in reqs], kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ragged", action="store_true", help="prompt i has prompt-len + i tokens: every row at its own "
                    "position (the general path left-pads its caches into one batched forward)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_moe(512, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(f"r{i}", torch.randint(5, 512, (args.prompt_len + i * args.ragged,), generator=g).tolist(),
                              SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=i))
            for i in range(args.requests)]
    tps: dict[str, list[float]] = {"lean": [], "general": []}
    ids: dict[str, list[list[int]]] = {}
    kv: dict[str, int] = {}
    for rnd in range(args.repeats):
        for path in (("lean", "general") if rnd % 2 == 0 else ("general", "lean")):
            t, ids[path], kv[path] = _run(model, reqs, path)
            tps[path].append(t)
    med = {p: statistics.median(v) for p, v in tps.items()}
    print(json.dumps({
        "decode_tokens_per_s": {p: round(v, 1) for p, v in med.items()},
        "lean_over_general": round(med["lean"] / med["general"], 2),
        "rounds": {p: [round(x, 1) for x in v] for p, v in tps.items()},
        "kv_bytes": kv, "same_tokens": ids["lean"] == ids["general"],
        "setup": vars(args) | {"threads": 1, "model": "tiny Qwen3-MoE (hidden 128, 4 layers, 8 experts, top-2)"},
    }, indent=1))


if __name__ == "__main__":
    main()
