"""Benchmark: how often the rollout engine and the trainer route a token to different experts, what that does to the
train-rollout log-prob gap, what routing replay (`k3post.routing_replay`, ``rl.rollout.routing_replay``) leaves of it, and
what recording costs.

Setup: a model folder (default: a fresh tiny Qwen3-MoE built here; the numbers of docs/decisions.md §routingreplay use
a demo run's ``experts/general.max``), its tokenizer, ``--prompts`` held-out general.arithmetic prompts at max
effort (the demo's RL prompts: the reference rendering up to the first sampled token), each sampled ``--k`` times
at temperature 1, ``--max-tokens`` tokens at most, one torch thread. The trainer is the model in fp32 with the
demo's MX QAT applied (as `k3post demo` trains it). Conditions, each a fresh engine over the same requests with
route recording on:

    demo        the demo's engine: QAT, HF op order, ``--slots`` slots, fp32
    qat_fast    ``engine.qat_op_order=fast`` (cheaper ops around the same fake-quantized tensors)
    bf16        the engine's model in bf16 (the trainer stays fp32): the common GPU setup
    batch1      one slot: every request decoded alone (batch composition moves MXFP8 roundings)

For each: the trainer's forward over every sampled sequence (`k3post.policy_step.policy_grads`, same weights as the
engine, no optimizer step) without and with replay: ``mismatch`` = positions whose own top-k differs from the
engine's in at least one MoE layer / positions recorded; ``gap`` = |trainer log-prob - engine log-prob| over the
sampled tokens (mean and max). Cost (``demo`` only, interleaved repeats in this process): the engine's wall time with
recording against without, and the trainer's forward + backward with replay against without.

Run: ``python bench/routing_replay.py [--model DIR] [--prompts 16 --k 4 --max-tokens 128 --repeats 3]``. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary  # noqa: E402


def _prompts(tok: Any, n: int) -> list[list[int]]:
    from k3post.envs.families.streams import eval_tasks
    from k3post.rollout.evaluation import _reference_rendering
    from k3post.xtml import XTML

    x = XTML(tok)
    out = []
    for task in eval_tasks(["general.arithmetic"], n, difficulty=1):
        _, rend = _reference_rendering(x, task, "max", "think", verify=False)
        out.append(list(rend.ids[: list(rend.loss_mask).index(True)]))
    return out


def _requests(prompts: list[list[int]], k: int, max_tokens: int) -> list[Any]:
    from k3post.rollout import GenerationRequest, SamplingParams

    return [GenerationRequest(f"p{i}s{j}", p, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 * i + j))
            for i, p in enumerate(prompts) for j in range(k)]


def sampling_args(doc: str | None, *, max_tokens: int) -> argparse.ArgumentParser:
    """The command line of a bench that samples the demo's prompts: model / tokenizer folders, prompts, samples per
    prompt, tokens per sample, engine slots, timing repeats."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a fresh tiny Qwen3-MoE)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    return ap


def qat_model(model_dir: str | None, tokenizer_dir: str | None) -> tuple[torch.nn.Module, Any]:
    """(model with the demo's MX QAT applied, in eval mode; its tokenizer): the folder's, or a fresh tiny Qwen3-MoE
    and a small XTML tokenizer trained here."""
    from k3post.models import build_tiny_moe, load_model
    from k3post.quant.qat import QATConfig, apply_qat
    from k3post.tokenizer import load_tokenizer

    if model_dir is None:
        from k3post.tokenizer import train_tokenizer
        from k3post.xtml import EOM

        tok = train_tokenizer(["What is 12 + 30? The answer is 42. Let me think step by step."] * 50, vocab_size=400)
        model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.convert_tokens_to_ids(EOM))
    else:
        tok = load_tokenizer(tokenizer_dir or model_dir)
        model = load_model(model_dir)
    apply_qat(model, QATConfig())
    return model.eval(), tok


def _engine(model: torch.nn.Module, tok: Any, slots: int, *, record: bool, op_order: str = "hf") -> Any:
    from k3post.rollout import EmbeddedEngine

    return EmbeddedEngine(model, tok, max_batch_size=slots, max_model_len=1024, record_routes=record,
                          qat_op_order=op_order)


def _seqs(results: list[Any]) -> list[Any]:
    from k3post.policy_step import TokenSequence

    out = []
    for r in results:
        P = len(r.prompt_ids)
        mask = [False] * P + [True] * len(r.output_ids)
        out.append(TokenSequence(r.prompt_ids + r.output_ids, mask, [0.0] * P + r.output_logprobs,
                                 [0.0] * len(mask), [-1] * P + r.output_versions, routes=r.routes))
    return out


def _trainer_pass(trainer: torch.nn.Module, seqs: list[Any], replay: bool) -> dict[str, float]:
    """The trainer's forward + backward over ``seqs`` (`policy_grads`, no optimizer step): routing mismatch and gap."""
    from k3post.policy_step import plan_micro_batches, policy_grads

    groups = plan_micro_batches(seqs, 4096)
    trainer.zero_grad(set_to_none=True)
    s = policy_grads(trainer, [([seqs[j] for j in idx], p) for idx, p in groups], pad_id=0,
                     token_normalizer=float(sum(x.num_trainable for x in seqs)), version=0, routing_replay=replay)
    known = s.get("routes_known", 0.0)
    return {"mismatch": s["routes_mismatched"] / known if known else float("nan"), "positions": known,
            "gap_mean": s["gap_sum"] / s["gap_n"], "gap_max": s["max/gap"], "tokens": s["gap_n"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = sampling_args(__doc__, max_tokens=128).parse_args(argv)
    torch.set_num_threads(1)
    model, tok = qat_model(args.model, args.tokenizer)
    reqs = _requests(_prompts(tok, args.prompts), args.k, args.max_tokens)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    conditions = {
        "demo": lambda: _engine(model, tok, args.slots, record=True),
        "qat_fast": lambda: _engine(model, tok, args.slots, record=True, op_order="fast"),
        "bf16": lambda: _engine(bf16, tok, args.slots, record=True),
        "batch1": lambda: _engine(model, tok, 1, record=True),
    }
    out: dict[str, Any] = {"machine": machine_state(), "requests": len(reqs)}
    demo_results = None
    for name, make in conditions.items():
        t0 = time.perf_counter()
        res = make().generate(reqs)
        if name == "demo":
            demo_results = res
        seqs = _seqs(res)
        off, on = _trainer_pass(model, seqs, False), _trainer_pass(model, seqs, True)
        row = {"sampled_tokens": off["tokens"], "positions": off["positions"], "mismatch_off": off["mismatch"],
               "gap_mean_off": off["gap_mean"], "gap_max_off": off["gap_max"], "mismatch_on": on["mismatch"],
               "gap_mean_on": on["gap_mean"], "gap_max_on": on["gap_max"], "seconds": time.perf_counter() - t0}
        out[name] = row
        print(f"{name:9s} positions {row['positions']:.0f}  routed differently {row['mismatch_off']:.4f} | gap mean "
              f"{row['gap_mean_off']:.2e} max {row['gap_max_off']:.3g}  ->  replayed: gap mean {row['gap_mean_on']:.2e} "
              f"max {row['gap_max_on']:.3g}", flush=True)
    # cost: recording in the engine, replay in the trainer (same requests, interleaved repeats)
    assert demo_results is not None
    seqs = _seqs(demo_results)
    plain = [dataclasses.replace(s, routes=None) for s in seqs]
    t = interleaved({
        "engine_record": lambda: _engine(model, tok, args.slots, record=True).generate(reqs) and None,
        "engine_plain": lambda: _engine(model, tok, args.slots, record=False).generate(reqs) and None,
        "trainer_replay": lambda: _trainer_pass(model, seqs, True) and None,
        "trainer_own": lambda: _trainer_pass(model, plain, False) and None,
    }, repeats=args.repeats, warmup=0)
    out.update(ratio_summary("engine_record_over_plain", t["engine_record"], t["engine_plain"]))
    out.update(ratio_summary("trainer_replay_over_own", t["trainer_replay"], t["trainer_own"]))
    out["engine_plain_s"] = statistics.median(t["engine_plain"])
    out["trainer_own_s"] = statistics.median(t["trainer_own"])
    print(f"cost: engine with recording / without {out['engine_record_over_plain']:.3f} "
          f"(paired {out['engine_record_over_plain_min']:.3f}..{out['engine_record_over_plain_max']:.3f}); trainer "
          f"forward + backward with replay / without routes {out['trainer_replay_over_own']:.3f} "
          f"({out['trainer_replay_over_own_min']:.3f}..{out['trainer_replay_over_own_max']:.3f})", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
