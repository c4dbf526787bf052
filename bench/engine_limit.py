"""How far the lean engine's decode step is from this CPU's compute limit, at batch 1, 8, 32 and 128, with and without QAT.

    python bench/engine_limit.py [--batches 1,8,32,128] [--context 128] [--steps 20] [--threads 1] [--repeats 5]

For each batch B, B requests of ``--context`` prompt tokens are admitted, a few decode steps run as warm-up, then
``--steps`` engine steps are timed (each decodes one token for every row; no admission happens in them). The limit
is the time the model's own arithmetic would take at the machine's measured GEMM rate:

    flops/token = Σ_layers [2·D·(H·E + 2·G·E) + 2·H·E·D          q, k, v, o projections
                            + 2·D·X + k·3·2·D·I                    router, the top-k experts (gate, up, down)
                            + 4·H·E·ctx]                           QK^T and PV over the context
                  + 2·D·V                                          lm_head
    limit(B)    = B · flops/token / peak,      peak = fp32 FLOP/s of a 1024³ matmul on ``--threads`` threads
    ratio(B)    = measured step time / limit(B)

(ctx: the mean context over the timed steps; the engine's dense MoE runs all X experts on few tokens, more work than
the limit counts: the ratio charges it to the engine.) The last line is JSON with ``limit_ratio_b<B>`` (QAT on, as
the demo runs, with the engine's default ``qat_op_order`` "hf") and ``limit_ratio_b<B>_noqat``.

**QAT op orders side by side.** For each B, two engines on the same QAT model and the same B requests, one per
``qat_op_order`` ("hf", HF's op order and the default; "fast", the opt-in), time ``--steps`` decode steps each in ``--repeats``
interleaved rounds (order rotated, `common.interleaved`); ``qat_hf_over_fast_b<B>`` is the median of the rounds'
paired ratios (hf step / fast step), with its min and max in the table. Caveats: one model size (the demo's tiny preset unless ``--hidden`` /
``--layers`` say otherwise); the peak is a large square GEMM's, which small-batch GEMMs cannot reach on any library.

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
from common import interleaved, machine_state  # noqa: E402

from k3post.models import build_tiny_moe  # noqa: E402
from k3post.quant.qat import QATConfig, apply_qat  # noqa: E402
from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams  # noqa: E402


def flops_per_token(config: Any, context: float) -> float:
    """The model's arithmetic for one decoded token at ``context`` positions of attention (module doc)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    D, H, G, L, V = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers, c.vocab_size
    E = getattr(c, "head_dim", None) or D // H
    X = getattr(c, "num_experts", 0) or 0
    if X:
        mlp = 2 * D * X + c.num_experts_per_tok * 3 * 2 * D * c.moe_intermediate_size
    else:
        mlp = 3 * 2 * D * c.intermediate_size
    per_layer = 2 * D * (H * E + 2 * G * E) + 2 * H * E * D + mlp + 4 * H * E * context
    return L * per_layer + 2 * D * V


def gemm_peak(n: int = 1024, repeats: int = 5) -> float:
    """fp32 FLOP/s of an n³ matmul at the current thread count (median of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def decoding_engine(model: torch.nn.Module, batch: int, context: int, steps: int, warmup: int = 3,
                    qat_op_order: str = "hf") -> EmbeddedEngine:
    """An engine holding ``batch`` running rows that all sit at the same position (``context`` prompt tokens each,
    prefilled, then ``warmup`` decode steps), with room for ``steps`` more decode steps before any row finishes."""
    g = torch.Generator().manual_seed(batch)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    engine = EmbeddedEngine(model, None, max_batch_size=batch, max_model_len=context + warmup + steps + 8,
                            max_prefill_tokens=batch * context, qat_op_order=qat_op_order)
    for i in range(batch):
        engine.add_request(GenerationRequest(f"r{i}", torch.randint(5, vocab, (context,), generator=g).tolist(),
                                             SamplingParams(max_tokens=warmup + steps + 4, ignore_eos=True, seed=i,
                                                            stop_ids=())))
    engine.step()  # admission: every prompt prefilled, first tokens sampled
    if engine.num_running != batch:
        raise RuntimeError(f"only {engine.num_running} of {batch} rows admitted in one step")
    for _ in range(warmup):
        engine.step()
    return engine


def timed_decode(engine: EmbeddedEngine, steps: int) -> float:
    """Seconds per step of ``steps`` engine steps, each of which must decode one token for every running row."""
    batch, before = engine.num_running, engine.stats["decode_tokens"]
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    if engine.stats["decode_tokens"] - before != batch * steps:
        raise RuntimeError("a timed step admitted or finished a request: the steps are not all decode steps")
    return dt / steps


def decode_step(model: torch.nn.Module, batch: int, context: int, steps: int, warmup: int = 3) -> tuple[float, float]:
    """(seconds per decode step, mean context over the timed steps) of ``batch`` rows that all sit at the same
    position: ``context`` prompt tokens each, prefilled and warmed up before the clock starts."""
    engine = decoding_engine(model, batch, context, steps, warmup)
    return timed_decode(engine, steps), context + 1 + warmup + (steps - 1) / 2


def qat_order_ratio(model: torch.nn.Module, batch: int, context: int, steps: int, repeats: int) -> dict[str, float]:
    """Paired per-round ratios, hf op order's decode step over the fast order's, on one QAT model (module doc)."""
    engines = {o: decoding_engine(model, batch, context, steps * (repeats + 1), qat_op_order=o) for o in ("fast", "hf")}
    if engines["fast"]._lean.weights().exact or not engines["hf"]._lean.weights().exact:
        raise RuntimeError("the QAT op-order comparison needs a model with QAT applied")
    times = interleaved({o: (lambda e=e: timed_decode(e, steps)) for o, e in engines.items()}, repeats=repeats)
    ratios = [h / f for h, f in zip(times["hf"], times["fast"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "fast_ms": statistics.median(times["fast"]) * 1e3, "hf_ms": statistics.median(times["hf"]) * 1e3}


def measure(batches: list[int], context: int, steps: int, hidden: int | None = None, layers: int | None = None,
            vocab: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """The table (one row per batch and QAT setting) and the JSON summary of the module doc."""
    kw = {k: v for k, v in {"hidden_size": hidden, "num_hidden_layers": layers}.items() if v}
    base = build_tiny_moe(vocab, "tiny", seed=0, **kw).eval()
    peak = gemm_peak()
    rows, out, orders = [], {}, []
    for qat in (True, False):
        model = build_tiny_moe(vocab, "tiny", seed=0, **kw).eval()
        model.load_state_dict(base.state_dict())
        if qat:
            apply_qat(model, QATConfig(enabled=True))
        for b in batches:
            step_s, ctx = decode_step(model, b, context, steps)
            limit_s = b * flops_per_token(model.config, ctx) / peak
            ratio = step_s / limit_s
            rows.append({"batch": b, "qat": qat, "ms_per_step": round(step_s * 1e3, 3),
                         "tokens_per_s": round(b / step_s, 1), "limit_ms": round(limit_s * 1e3, 4), "ratio": round(ratio, 2)})
            out[f"limit_ratio_b{b}" + ("" if qat else "_noqat")] = round(ratio, 2)
        if qat and repeats:
            for b in batches:
                r = qat_order_ratio(model, b, context, steps, repeats)
                orders.append({"batch": b, **{k: round(v, 3) for k, v in r.items()}})
                out[f"qat_hf_over_fast_b{b}"] = round(r["median"], 3)
    return {"rows": rows, "qat_orders": orders, "peak_gflops": round(peak / 1e9, 1),
            "flops_per_token_at_context": round(flops_per_token(base.config, context)), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the QAT op-order comparison (0: skip it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = measure([int(b) for b in args.batches.split(",")], args.context, args.steps, args.hidden, args.layers,
                  repeats=args.repeats)
    print(f"peak {res['peak_gflops']} GFLOP/s ({args.threads} thread(s)); {res['flops_per_token_at_context']:,} FLOP a token "
          f"at context {args.context}")
    print(f"{'B':>5} {'QAT':>5} {'ms/step':>9} {'tokens/s':>10} {'limit ms':>9} {'× limit':>8}")
    for r in res["rows"]:
        print(f"{r['batch']:>5} {str(r['qat']):>5} {r['ms_per_step']:>9} {r['tokens_per_s']:>10} {r['limit_ms']:>9} {r['ratio']:>8}")
    if res["qat_orders"]:
        print(f"QAT op orders, {args.repeats} interleaved rounds of {args.steps} steps: hf / fast step time")
        print(f"{'B':>5} {'fast ms':>9} {'hf ms':>9} {'hf/fast':>8} {'min':>6} {'max':>6}")
        for r in res["qat_orders"]:
            print(f"{r['batch']:>5} {r['fast_ms']:>9} {r['hf_ms']:>9} {r['median']:>8} {r['min']:>6} {r['max']:>6}")
    summary = {k: v for k, v in res.items() if k not in ("rows", "qat_orders")}
    print(json.dumps({**summary, "machine": machine_state(), "setup": vars(args)}))


if __name__ == "__main__":
    main()
