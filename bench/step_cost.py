"""Measure the rollout engine's step cost curve (`k3post.rollout.cost_model.CostCurve`) on this machine.

    python bench/step_cost.py --out curve.json [--device cpu|cuda] [--batches 1,2,4,8,16,32]
        [--contexts 128,512,1024,2048] [--prefill 16,64,256,1024,2048] [--steps 8] [--threads 1]
        [--hidden 64 --layers 2 --heads 2 --kv-heads 1 --experts 4 --moe 64 --vocab 1024]

**Decode**: for each (B, ctx), B requests of ``ctx`` random prompt tokens are admitted and prefilled
(not timed), ``--warmup`` decode steps run, then ``--steps`` decode steps are timed (each decodes one
token for every row; the rows' context grows by one a step, so the recorded context is the given one
plus the warm-up and half the timed steps; the curve files ``ctx`` itself, an error under
(warmup + steps) / ctx). The median over ``--repeats`` timed blocks is kept.
**Prefill**: a step admitting one request of P uncached tokens (the engine otherwise idle), median
of ``--repeats``.

The default model is ``bench/partial_rollout.py``'s policy shape (hidden 64, 2 layers, 4 experts,
vocabulary 1,024) with random weights (cost does not depend on the values); QAT off, as that bench
runs. On CUDA every timed region ends with ``torch.cuda.synchronize()``. Prints the table, writes the
curve JSON (``source`` names the machine, the model and this command) and prints one JSON line.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_state  # noqa: E402

from k3post.models import build_tiny_moe  # noqa: E402
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams  # noqa: E402
from k3post.rollout.cost_model import CostCurve  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine(model: Any, batch: int, max_len: int, prefill_budget: int) -> EmbeddedEngine:
    return EmbeddedEngine(model, None, max_batch_size=batch, max_model_len=max_len, max_prefill_tokens=prefill_budget,
                          prefix_sharing=False)


def _requests(vocab: int, n: int, length: int, max_tokens: int, seed: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(f"r{i}", torch.randint(5, vocab, (length,), generator=g).tolist(),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, stop_ids=()))
            for i in range(n)]


def decode_ms(model: Any, vocab: int, batch: int, context: int, steps: int, warmup: int, repeats: int,
              device: str) -> float:
    """Median milliseconds of one decode step of ``batch`` rows at ``context`` (module doc)."""
    total = warmup + steps * repeats + batch + 4  # + batch: the first rows decode while later ones are admitted
    engine = _engine(model, batch, context + total + 8, context)
    for r in _requests(vocab, batch, context, total, seed=batch * 7919 + context):
        engine.add_request(r)
    while engine.num_queued:
        engine.step()  # prefill (one per step under the budget; earlier rows already decode)
    for _ in range(warmup):
        engine.step()
    if engine.num_running != batch:
        raise RuntimeError(f"{engine.num_running} of {batch} rows running after admission")
    times = []
    for _ in range(repeats):
        before = engine.stats["decode_tokens"]
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        times.append((time.perf_counter() - t) / steps)
        if engine.stats["decode_tokens"] - before != batch * steps:
            raise RuntimeError("a timed step admitted or finished a request: not all decode steps")
    return 1000.0 * statistics.median(times)


def prefill_ms(model: Any, vocab: int, tokens: int, repeats: int, device: str) -> float:
    """Median milliseconds of a step that admits one request of ``tokens`` uncached tokens."""
    times = []
    for r in range(repeats + 1):
        engine = _engine(model, 1, tokens + 8, tokens)
        engine.add_request(_requests(vocab, 1, tokens, 2, seed=tokens + r)[0])
        _sync(device)
        t = time.perf_counter()
        engine.step()
        _sync(device)
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t)
    return 1000.0 * statistics.median(times)


def measure(args: argparse.Namespace) -> CostCurve:
    model = build_tiny_moe(
        args.vocab, seed=0, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, moe_intermediate_size=args.moe, num_experts=args.experts,
        intermediate_size=2 * args.moe, max_position_embeddings=max(args.contexts) + 4096,
    ).to(args.device).eval()
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
    t0 = time.perf_counter()
    table = []
    for b in args.batches:
        row = []
        for c in args.contexts:
            row.append(round(decode_ms(model, args.vocab, b, c, args.steps, args.warmup, args.repeats, args.device), 4))
            print(f"decode B {b:>4} ctx {c:>5}: {row[-1]:9.3f} ms/step", flush=True)
        table.append(row)
    pre = []
    for p in args.prefill:
        pre.append(round(prefill_ms(model, args.vocab, p, args.repeats, args.device), 4))
        print(f"prefill {p:>5} tokens: {pre[-1]:9.3f} ms", flush=True)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else machine_state()["cpu"]
    n_params = sum(p.numel() for p in model.parameters())
    source = (f"bench/step_cost.py on {dev} ({args.device}, {torch.get_num_threads()} CPU thread(s), torch "
              f"{torch.__version__}, {args.dtype}); Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} "
              f"experts, vocab {args.vocab} ({n_params / 1e6:.2f} M parameters), EmbeddedEngine lean path, QAT off; "
              f"measured {time.strftime('%Y-%m-%d')} in {time.perf_counter() - t0:.0f} s")
    return CostCurve(batches=list(args.batches), contexts=list(args.contexts), decode_ms=table,
                     prefill_tokens=list(args.prefill), prefill_ms=pre, source=source,
                     meta={"machine": machine_state(), "setup": {k: v for k, v in vars(args).items() if k != "out"}})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--out", required=True, help="curve JSON to write")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=ints, default=ints("1,2,4,8,16,32"))
    ap.add_argument("--contexts", type=ints, default=ints("128,512,1024,2048"))
    ap.add_argument("--prefill", type=ints, default=ints("16,64,256,1024,2048"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--moe", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    curve = measure(args)
    curve.save(args.out)
    print(f"wrote {args.out}: {curve.source}")
    print(json.dumps({"out": args.out, "decode_ms": curve.decode_ms, "prefill_ms": curve.prefill_ms,
                      "step_ms": round(curve.step_ms, 4)}))


if __name__ == "__main__":
    main()
