"""Bit-for-bit parity of the training stages across a refactor of the trainer (issue 33 §trainer).

Usage::

    PYTHONPATH=<checkout A> python bench/trainer_parity.py run A.pt      # the stages on A's code
    PYTHONPATH=<checkout B> python bench/trainer_parity.py run B.pt      # the same on B's code
    python bench/trainer_parity.py compare A.pt B.pt                    # every tensor and metric equal?

``run`` trains, at seed 0 on one torch thread, tiny Qwen3-MoEs through each stage's public entry point (the
ones whose signatures the refactor kept): `train_sft` (40 steps, grad_accum 2; then 6 steps with an MTP head
from step 3), `train_rl` (2 steps from the SFT model, λ = 0.5 so trajectories pause, shared prompts,
micro-batches of 256 tokens), `train_mopd` (2 steps, two experts) and `train_draft` (6 steps, 3 unrolled
steps, a checkpoint every 3). It saves every final weight and every logged metric (the timing ones left out).
``compare`` prints one JSON line and exits 1 naming the first tensor or metric that differs (``torch.equal``, dtypes
included; numbers by ``==``, nan equal to nan).

Shape legend: none.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             moe_intermediate_size=64, num_experts=4, intermediate_size=128)
_CORPUS = ["Hello! How are you today? I'm fine, thanks.",
           "The quick brown fox jumps over the lazy dog 1234567890 times.",
           'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n    return a + b\n',
           "What is 12 + 30? The answer is 42. Let me think step by step."] * 20


def _rows(stage_log: Any) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in stage_log.rows()]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(out: Path) -> None:
    from k3post.config.draft import DraftConfig
    from k3post.data import Sample, render_record
    from k3post.envs.families.registry import get_family
    from k3post.models import build_tiny_moe, save_model
    from k3post.stages.mopd import MOPDConfig, train_mopd
    from k3post.rewards.effort import EffortConfig, estimate_budgets
    from k3post.config import PolicyOptimConfig, RLConfig, RolloutConfig
    from k3post.envs.families.streams import domain_families, train_tasks
    from k3post.stages.rl import train_rl
    from k3post.rollout.embedded import EmbeddedEngine
    from k3post.stages.sft import SFTConfig, train_sft
    from k3post.spec.data import target_generations
    from k3post.spec.eagle3 import Eagle3Draft
    from k3post.spec.train import train_draft
    from k3post.synth.pipeline import synthesize
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    tok = train_tokenizer(_CORPUS, vocab_size=400)
    x = XTML(tok)

    def tiny(seed: int, **kw: Any) -> torch.nn.Module:
        return build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=x.eom_id, **_TINY, **kw)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recs = synthesize(get_family("general.arithmetic"), effort="max", n=200, seed=1)
        samples = [Sample(*render_record(x, r), source=str(i)) for i, r in enumerate(recs)]
        torch.manual_seed(0)
        model = tiny(0)
        cfg = SFTConfig(steps=40, lr=1e-2, pack_len=512, rows_per_batch=4, grad_accum=2, progress=False,
                        log_every=1000, save_every=20)
        r = train_sft(model, tok, samples, cfg, root / "sft", resume=False)
        res["sft"] = {"weights": _state(model), "losses": r.losses}
        print("sft", r.losses[0], r.losses[-1], flush=True)

        torch.manual_seed(0)
        m2 = tiny(0)
        cfg2 = replace(cfg, steps=6, mtp_weight=0.3, mtp_start_fraction=0.5, save_every=3)
        r2 = train_sft(m2, tok, samples, cfg2, root / "sft_mtp", resume=False)
        res["sft_mtp"] = {"weights": _state(m2), "mtp": _state(r2.mtp), "losses": r2.losses, "mtp_losses": r2.mtp_losses}
        print("sft_mtp", r2.losses[-1], r2.mtp_losses, flush=True)

        rl_cfg = RLConfig(domain="general", families=["general.arithmetic"], steps=2, n_tasks=6, eval_n=4,
                          eval_max_tokens=40, save_every=1, progress=False, micro_batch_tokens=256,
                          effort_control=EffortConfig(tau_max=1.0, max_cap=1.0),
                          rollout=RolloutConfig(n_prompts=3, k=4, max_tokens=40, lambda_=0.5),
                          optim=PolicyOptimConfig(lr=1e-3))
        tasks = train_tasks(domain_families(rl_cfg.domain, rl_cfg.families), rl_cfg.n_tasks, difficulty=rl_cfg.difficulty)
        budgets = estimate_budgets(EmbeddedEngine(model, tok), tasks, xtml=x, samples_per_task=4, seed=0,
                                   max_tokens=rl_cfg.rollout.max_tokens)
        policy = copy.deepcopy(model)
        rr = train_rl(policy, tok, rl_cfg, root / "rl", budgets=budgets, evaluate=False)
        res["rl"] = {"weights": _state(policy), "rows": _rows(rr.metrics)}
        print("rl", [(row.get("train/loss"), row.get("train/grad_norm")) for row in res["rl"]["rows"]], flush=True)

        teacher = str(save_model(tiny(1, initializer_range=0.1), root / "t1"))
        mcfg = MOPDConfig(experts={"general.high": teacher, "general.max": teacher}, effort_mix={"high": 0.5, "max": 0.5},
                          domains=["general"], families={"general": ["general.arithmetic"]}, max_resident=1,
                          rl=RLConfig(steps=2, n_tasks=6, save_every=1, progress=False,
                                      rollout=RolloutConfig(n_prompts=3, k=3, max_tokens=24, lambda_=0.5),
                                      optim=PolicyOptimConfig(lr=3e-3)), teacher_sees_effort=False)
        student = tiny(0)
        rm = train_mopd(student, tok, mcfg, root / "mopd")
        res["mopd"] = {"weights": _state(student), "rows": _rows(rm.metrics)}
        print("mopd", [(row.get("train/loss"), row.get("train/grad_norm")) for row in res["mopd"]["rows"]], flush=True)

        target = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=x.eom_id,
                                initializer_range=0.2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                num_experts=4, num_experts_per_tok=2).eval()
        engine = EmbeddedEngine(target, tok, max_batch_size=16, max_model_len=512)
        dsamples = target_generations(engine, x, ["general.arithmetic"], n_per_family=8, efforts=["low", "max"],
                                      max_tokens=24, seed=3)
        dcfg = DraftConfig(steps=6, lr=3e-3, batch_size=4, ttt_steps=3, save_every=3, log_every=1, warmup_steps=2,
                           grad_clip=0.5, progress=False)
        torch.manual_seed(0)
        draft = Eagle3Draft.from_target(target, (1, 1, 2))
        rd = train_draft(target, draft, dsamples, dcfg, root / "draft", pad_id=tok.pad_token_id)
        res["draft"] = {"weights": _state(draft), "rows": rd.history}
        print("draft", [h["loss"] for h in rd.history], flush=True)
    torch.save(res, out)
    print(f"wrote {out}")


def _diff(a: Any, b: Any, where: str) -> str | None:
    """The path of the first difference between ``a`` and ``b`` (nested dicts / lists of tensors and numbers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if ok else where
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))}"
        return next((d for k in a if (d := _diff(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        return next((d for i, (u, v) in enumerate(zip(a, b)) if (d := _diff(u, v, f"{where}[{i}]"))), None)
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)  # nan == nan here
    return None if same else f"{where}: {a!r} vs {b!r}"


def compare(a: Path, b: Path) -> int:
    """Prints one JSON line (identical, the first difference, the stages, the weight tensors); 1 when they differ."""
    ra, rb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    d = _diff(ra, rb, "")
    n = sum(len(v["weights"]) for v in ra.values())
    print(json.dumps({"identical": d is None, "first_difference": d, "stages": sorted(ra), "weight_tensors": n}))
    return 1 if d else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    ns = p.parse_args(argv)
    if ns.cmd == "run":
        run(ns.out)
        return 0
    return compare(ns.a, ns.b)


if __name__ == "__main__":
    sys.exit(main())
