"""What ``torch.compile`` (inductor) does to the lean engine's decode step on this machine: the layer stack of one decode
step, eager against compiled, at fixed batch B and context, with and without QAT.

    python bench/compile_decode.py [--batches 1,8,32] [--context 128] [--calls 30] [--repeats 7] [--no-qat]

For each B an engine holds B rows at the same position (`engine_limit.decoding_engine`). ``decode_stack`` is
`LeanForward.decode_stack`, the tensor work of the engine's decode step (embedding, per layer q/k/v, q/k norm and
rotary, the KV write, attention over the slot cache, o_proj, the MoE, then the final norm and lm_head), called with
one explicit mask (``LeanForward.decode_mask``) and one attention range instead of the step's segment split, and
without the Python around it. It is checked against ``LeanForward.decode`` (max |Δ| printed; 0 expected), then compiled with ``torch.compile(dynamic=False)`` (one graph
for this B and context) and timed against its eager self in ``--repeats`` interleaved rounds of ``--calls`` calls
(`common.interleaved`). Printed per (QAT, B): eager and compiled ms per call, their paired ratio (median, min-max
over the rounds), the compile's seconds (the first call; it reads and fills inductor's on-disk cache, so a second
run of the script compiles faster), and compiled-vs-eager max |Δ| of the logits with whether the argmax agrees.

Caveats: the tiny preset unless ``--hidden`` / ``--layers`` say otherwise; the engine's own Python around a step
(admission, sampling, bookkeeping) is not timed; above ``dense_moe_max_tokens`` (64) rows the stack calls HF's MoE
block, which may not compile (the row then says why). The last line is JSON with ``speedup_b<B>`` and
``speedup_b<B>_noqat`` (eager / compiled), ``compile_s_b<B>``, ``max_abs_diff_b<B>`` and the machine state.
Measured: docs/decisions.md, issue 32 §compile24.

Shape legend: B rows, L positions attended (context + 1), G kv heads, H query heads, E head dim, N = H + G.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state  # noqa: E402
from engine_limit import decoding_engine  # noqa: E402

from k3post.models import build_tiny_moe  # noqa: E402
from k3post.quant.qat import QATConfig, apply_qat  # noqa: E402
from k3post.rollout.embedded.forward import LeanForward, WeightPlan  # noqa: E402


def decode_stack(lf: LeanForward, w: WeightPlan, ids_B: torch.Tensor, pos_B: torch.Tensor, mask: torch.Tensor,
                 B: int, L: int) -> torch.Tensor:
    """Logits [B, V] of one decode step over slots 0..B-1 at positions pos_B: the engine's own
    ``LeanForward.decode_stack`` with one explicit mask (``LeanForward.decode_mask``) and one attention range."""
    return lf.decode_stack(w, ids_B, pos_B, mask, [(0, B, L)], L)


def measure_one(model: torch.nn.Module, batch: int, context: int, calls: int, repeats: int) -> dict[str, Any]:
    """One (model, B) row of the module doc."""
    engine = decoding_engine(model, batch, context, steps=8)
    lf = engine._lean
    w = lf.weights()
    pos = context + 3  # the rows' next position after the prompt, the first token and 3 warm-up steps
    L = pos + 1
    g = torch.Generator().manual_seed(batch)
    ids_B = torch.randint(5, model.config.vocab_size, (batch,), generator=g)
    pos_B = torch.full((batch,), pos, dtype=torch.long)
    args = (lf, w, ids_B, pos_B, lf.decode_mask(w, pos_B, L), batch, L)
    with torch.inference_mode():
        eager = decode_stack(*args)
        row: dict[str, Any] = {"batch": batch, "stack_vs_decode": float((eager - lf.decode(ids_B.tolist(), [pos] * batch)).abs().max())}
        torch._dynamo.reset()  # a fresh cache: no guards of an earlier (model, B) checked on every call
        compiled = torch.compile(decode_stack, dynamic=False)
        t = time.perf_counter()
        try:
            out = compiled(*args)
        except Exception as exc:  # noqa: BLE001 - a shape inductor cannot compile is a result of this bench
            cause = re.search(r"got \w+\('([^']*)'", str(exc))  # dynamo wraps the op's own error
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" + (f" ({cause.group(1)})" if cause else "")
            return row
        row["compile_s"] = time.perf_counter() - t
        row["max_abs_diff"] = float((out - eager).abs().max())
        row["argmax_equal"] = bool((out.argmax(-1) == eager.argmax(-1)).all())

        def arm(fn: Any) -> Any:
            def run() -> None:
                for _ in range(calls):
                    fn(*args)
            return run

        times = interleaved({"eager": arm(decode_stack), "compiled": arm(compiled)}, repeats=repeats)
    ratios = [e / c for e, c in zip(times["eager"], times["compiled"])]
    row.update(eager_ms=statistics.median(times["eager"]) / calls * 1e3,
               compiled_ms=statistics.median(times["compiled"]) / calls * 1e3,
               speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-qat", action="store_true", help="only the model without QAT")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    kw = {k: v for k, v in {"hidden_size": a.hidden, "num_hidden_layers": a.layers}.items() if v}
    summary: dict[str, Any] = {}
    for qat in ((False,) if a.no_qat else (True, False)):
        model = build_tiny_moe(1024, "tiny", seed=0, **kw).eval()
        if qat:
            apply_qat(model, QATConfig(enabled=True))
        sfx = "" if qat else "_noqat"
        for b in (int(x) for x in a.batches.split(",")):
            r = measure_one(model, b, a.context, a.calls, a.repeats)
            if "error" in r:
                print(f"QAT {qat!s:5} B {b:3}: does not compile: {r['error']}", flush=True)
                summary[f"error_b{b}{sfx}"] = r["error"]
                continue
            print(f"QAT {qat!s:5} B {b:3}: eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms, "
                  f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}); compile {r['compile_s']:.1f} s; "
                  f"max|Δ| {r['max_abs_diff']:.1e} (argmax equal: {r['argmax_equal']}); stack vs decode "
                  f"{r['stack_vs_decode']:.1e}", flush=True)
            summary[f"speedup_b{b}{sfx}"] = r["speedup"]
            summary[f"compile_s_b{b}{sfx}"] = r["compile_s"]
            summary[f"max_abs_diff_b{b}{sfx}"] = r["max_abs_diff"]
            summary[f"stack_vs_decode_b{b}{sfx}"] = r["stack_vs_decode"]
    summary["machine"] = machine_state()
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
