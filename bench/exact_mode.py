"""Benchmark: what the exact mode (``rl.rollout.exact``, `k3post.rollout.embedded.exact`) buys and costs against the default
engine and trainer.

Setup: as `bench/routing_replay.py` (a model folder with the demo's MX QAT applied, default a fresh tiny Qwen3-MoE;
``--prompts`` held-out general.arithmetic prompts at max effort, each sampled ``--k`` times at temperature 1, at most
``--max-tokens`` tokens; one torch thread). Measured:

    gap            max |engine log-prob - trainer log-prob| over the sampled tokens, same weights: the default engine
                   (lean forward, HF op order) against the trainer's forward (`k3post.policy_step.policy_grads`), and
                   the exact engine against the trainer's exact recomputation
    batch_invariant  the exact engine with 1 slot (every request alone) gives the same tokens and log-probs, bit for
                   bit, as with ``--slots`` slots
    cost           interleaved repeats in this process: the exact engine's wall time over the same requests against
                   the default engine's; the trainer's forward + backward with exact values against without; one
                   decode step of B rows at position 100 (exact forward against the lean one) for B in 1, 8, 32

Caveats: the engine ratio covers prefill, decode and sampling of these requests (short arithmetic answers); the
trainer ratio excludes the optimizer step (the same in both). Run: ``python bench/exact_mode.py [--model DIR]
[--prompts 16 --k 4 --max-tokens 64 --repeats 3]``. The last line is JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary  # noqa: E402
from routing_replay import _prompts, _requests, _seqs, qat_model, sampling_args  # noqa: E402


def _engine(model: torch.nn.Module, tok: Any, slots: int, exact: bool) -> Any:
    from k3post.rollout import EmbeddedEngine

    return EmbeddedEngine(model, tok, max_batch_size=slots, max_model_len=1024, exact=exact)


def _trainer_pass(model: torch.nn.Module, seqs: list[Any], exact: bool) -> dict[str, float]:
    """Forward + backward of the policy loss over ``seqs`` (no optimizer step): the gap on the sampled tokens."""
    from k3post.policy_step import plan_micro_batches, policy_grads

    model.zero_grad(set_to_none=True)
    s = policy_grads(model, [([seqs[j] for j in idx], p) for idx, p in plan_micro_batches(seqs, 4096)], pad_id=0,
                     token_normalizer=float(sum(x.num_trainable for x in seqs)), version=0, exact=exact)
    return {"gap_mean": s["gap_sum"] / s["gap_n"], "gap_max": s["max/gap"], "tokens": s["gap_n"]}


def _decode_arms(model: torch.nn.Module, batches: list[int], position: int = 100) -> dict[str, Any]:
    """One decode step of B rows at ``position`` (contexts prefilled once), lean and exact, per B."""
    from k3post.rollout.embedded.exact import ExactForward
    from k3post.rollout.embedded.forward import LeanForward

    V = model.get_input_embeddings().num_embeddings
    arms: dict[str, Any] = {}
    for B in batches:
        ctx = torch.randint(2, V, (B, position), generator=torch.Generator().manual_seed(B)).tolist()
        lean, exact = LeanForward(model, B, 512), ExactForward(model, B, 512)
        with torch.inference_mode():
            lean.forward_chunks(ctx, [0] * B, list(range(B)), logits=False)
            exact.forward_chunks(ctx, [0] * B, list(range(B)), logits=False)

        def lean_step(f: Any = lean, B: int = B) -> None:
            with torch.inference_mode():
                f.decode([5] * B, [position] * B)

        def exact_step(f: Any = exact, B: int = B) -> None:
            f.forward_chunks([[5]] * B, [position] * B, list(range(B)))

        arms[f"decode_lean_b{B}"], arms[f"decode_exact_b{B}"] = lean_step, exact_step
    return arms


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = sampling_args(__doc__, max_tokens=64).parse_args(argv)
    torch.set_num_threads(1)
    model, tok = qat_model(args.model, args.tokenizer)
    reqs = _requests(_prompts(tok, args.prompts), args.k, args.max_tokens)
    out: dict[str, Any] = {"machine": machine_state(), "requests": len(reqs)}
    default_res = _engine(model, tok, args.slots, False).generate(reqs)
    exact_res = _engine(model, tok, args.slots, True).generate(reqs)
    alone = _engine(model, tok, 1, True).generate(reqs)
    out["batch_invariant"] = all(a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
                                 for a, b in zip(alone, exact_res))
    default_seqs, exact_seqs = _seqs(default_res), _seqs(exact_res)
    d, e = _trainer_pass(model, default_seqs, False), _trainer_pass(model, exact_seqs, True)
    out.update(sampled_tokens=e["tokens"], gap_default_mean=d["gap_mean"], gap_default_max=d["gap_max"],
               gap_exact_mean=e["gap_mean"], gap_exact_max=e["gap_max"])
    print(f"gap on {e['tokens']:.0f} sampled tokens: default engine vs trainer max {d['gap_max']:.3g} (mean "
          f"{d['gap_mean']:.2e}); exact engine vs exact trainer max {e['gap_max']:.3g}; exact engine with 1 slot = with "
          f"{args.slots}: {out['batch_invariant']}", flush=True)
    arms = {
        "engine_exact": lambda: _engine(model, tok, args.slots, True).generate(reqs) and None,
        "engine_default": lambda: _engine(model, tok, args.slots, False).generate(reqs) and None,
        "trainer_exact": lambda: _trainer_pass(model, exact_seqs, True) and None,
        "trainer_default": lambda: _trainer_pass(model, exact_seqs, False) and None,
    }
    batches = [1, 8, 32]
    t = interleaved({**arms, **_decode_arms(model, batches)}, repeats=args.repeats, warmup=1)
    out.update(ratio_summary("engine_exact_over_default", t["engine_exact"], t["engine_default"]))
    out.update(ratio_summary("trainer_exact_over_default", t["trainer_exact"], t["trainer_default"]))
    for B in batches:
        out.update(ratio_summary(f"decode_exact_over_lean_b{B}", t[f"decode_exact_b{B}"], t[f"decode_lean_b{B}"]))
        out[f"decode_lean_b{B}_ms"] = 1e3 * statistics.median(t[f"decode_lean_b{B}"])
    print(f"cost: engine exact / default {out['engine_exact_over_default']:.2f} (paired "
          f"{out['engine_exact_over_default_min']:.2f}..{out['engine_exact_over_default_max']:.2f}); trainer forward + "
          f"backward exact / default {out['trainer_exact_over_default']:.2f}; decode step exact / lean "
          + ", ".join(f"B={B} {out[f'decode_exact_over_lean_b{B}']:.2f}" for B in batches), flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
