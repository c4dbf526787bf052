"""Choosing the SFT checkpoint by a validation split (``sft.select: validation``).

An SFT run's kept checkpoints can differ widely in what they pass: the demo's max-effort coding flipped between
0.64 and 0.11 over checkpoints 200 steps apart, and validation tasks tracked the held-out tests (Pearson 0.93 over
12 checkpoints; docs/decisions.md, issue 31 §draws18). With ``sft.select: validation`` the run scores every kept
checkpoint on ``sft.select_n`` validation tasks per domain of ``sft.select_domains`` at ``sft.select_effort``
(greedy, as the experts' "before" rows are measured; tasks of `k3post.envs.families.streams.VALIDATION_SEED`,
disjoint from the held-out tests, the training streams and the SFT data) and makes the one with the highest mean
pass rate the SFT model. Ties go to the later checkpoint. The choice is ``sft/selection.json``.

A chosen checkpoint that is not the last one replaces ``sft/final`` (its model, MTP head and tokenizer files), and
the last model moves to ``sft/last``; every later stage starts from ``sft/final`` as before. A resumed run that finds
``sft/selection.json`` for the same checkpoints keeps its choice without scoring again.

Shape legend: none.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3post.checkpoint import checkpoint_step, intact_checkpoints
from k3post.envs.families.streams import domain_families, eval_tasks
from k3post.errors import UserError
from k3post.io import atomic_write
from k3post.recipes.experts import load_policy
from k3post.rollout.evaluation import run_episodes, summarize_trajectories
from k3post.rollout.factory import build_engine, close_engine
from k3post.tokenizer import load_tokenizer
from k3post.xtml import XTML

if TYPE_CHECKING:
    from k3post.config import K3Config

__all__ = ["SELECTION_FILE", "domain_pass", "select_checkpoint"]

SELECTION_FILE = "selection.json"
#: files of a checkpoint folder that make up the model (the trainer's state and the manifest stay behind)
_TRAINER_FILES = frozenset({"trainer_state.pt", "manifest.json"})


def domain_pass(path: str | Path, cfg: "K3Config", effort: str, domains: Sequence[str], *, split: str = "test",
                n: int | None = None, max_tokens: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Greedy pass of the model in ``path`` at ``effort`` on each domain's held-out tasks as the experts' "before"
    rows score them (the domain's RL families, each turn capped at its ``eval_max_tokens`` or ``max_tokens[domain]``;
    general: ``data.n_eval`` tasks, the others ``rl.eval_n``; ``n`` overrides both), on the ``split`` ("test" or
    "validation"), on an embedded engine in this process (the domain's engine settings otherwise). Per domain:
    `summarize_trajectories`'s summary with the turn cap and the trajectories."""
    tok = load_tokenizer(path)
    xtml = XTML(tok)
    model = load_policy(path, cfg.qat)
    out: dict[str, dict[str, Any]] = {}
    for dom in domains:
        rc = cfg.rl.for_domain(dom, effort)
        fams = domain_families(dom, rc.families, with_judge=False)
        count = n if n is not None else (cfg.data.n_eval if dom == "general" else rc.eval_n)
        tasks = eval_tasks(fams, count, difficulty=rc.difficulty, split=split)
        cap = (max_tokens or {}).get(dom) or rc.eval_max_tokens
        # in this process, on these weights: a run's http engines serve another model (the policy it trains)
        local = dataclasses.replace(rc.rollout.engine, kind="embedded", urls=[], launch=0)
        engine = build_engine(model, tok, engine=local, role="checkpoint score", max_batch_size=rc.rollout.slots, seed=0)
        try:
            trajs = [t for ts in run_episodes(engine, xtml, tasks, effort=effort, max_tokens=cap) for t in ts]
        finally:
            close_engine(engine)
        out[dom] = {**summarize_trajectories(trajs), "turn_cap": cap, "trajectories": trajs}
    return out


def _install(src: Path, final: Path, last: Path) -> None:
    """``final`` becomes the model in checkpoint ``src``; the model that was there moves to ``last`` (replacing an
    older ``last``: a resumed stage saved its last model to ``final`` again). A crash between the steps leaves the
    checkpoint intact, and the next run redoes the copy."""
    if (final / "config.json").is_file():
        if last.exists():
            shutil.rmtree(last)
        final.rename(last)
    staging = final.with_name(final.name + ".selecting")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in _TRAINER_FILES:
            shutil.copy2(f, staging / f.name)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def select_checkpoint(cfg: "K3Config", sft_dir: Path) -> dict[str, Any] | None:
    """With ``sft.select: validation``: score the kept checkpoints, make the best one ``sft_dir/final`` (module doc)
    and return the choice (also in ``sft_dir/selection.json``); None with ``sft.select: last``. Call it right after
    the stage saved its last model to ``sft_dir/final``: that model is what moves to ``sft_dir/last``."""
    s = cfg.sft
    if s.select == "last":
        return None
    ckpts = intact_checkpoints(sft_dir / "checkpoints")
    if not ckpts:
        raise UserError(f"sft.select=validation: no complete checkpoint under {sft_dir / 'checkpoints'} to choose from "
                        "(were they deleted?); run with sft.select=last to keep the final step's model")
    names = [p.name for p in ckpts]
    done_file = sft_dir / SELECTION_FILE
    if done_file.is_file():
        done = json.loads(done_file.read_text())
        if [r["checkpoint"] for r in done["rows"]] == names:  # scored before: a resumed run keeps the choice
            if done["chosen"] != names[-1]:  # the stage saved its last model to final again: the choice goes back
                _install(sft_dir / "checkpoints" / done["chosen"], sft_dir / "final", sft_dir / "last")
            return done
    rows = []
    for p in ckpts:
        got = domain_pass(p, cfg, s.select_effort, s.select_domains, split="validation", n=s.select_n)
        per = {d: {"pass": r["pass_rate"], "n": r["n"], "ci95": r["pass_ci95"]} for d, r in got.items()}
        rows.append({"checkpoint": p.name, "step": checkpoint_step(p), "domains": per,
                     "mean_pass": statistics.fmean(v["pass"] for v in per.values())})
        print(f"  SFT checkpoint {p.name}: validation pass at {s.select_effort} "
              + ", ".join(f"{d} {v['pass']:.3f}" for d, v in per.items()) + f" (mean {rows[-1]['mean_pass']:.3f})", flush=True)
    best = max(range(len(rows)), key=lambda i: (rows[i]["mean_pass"], i))  # ties: the later checkpoint
    chosen = rows[best]["checkpoint"]
    out = {"select": s.select, "effort": s.select_effort, "n_per_domain": s.select_n, "split": "validation",
           "rows": rows, "chosen": chosen, "chosen_step": rows[best]["step"], "last": names[-1],
           "final": "the chosen checkpoint" if chosen != names[-1] else "the last checkpoint (unchanged)"}
    if chosen != names[-1]:
        _install(ckpts[best], sft_dir / "final", sft_dir / "last")
    atomic_write(done_file, json.dumps(out, indent=1))
    print(f"  SFT model: {chosen} (validation mean {rows[best]['mean_pass']:.3f}; the last, {names[-1]}: "
          f"{rows[-1]['mean_pass']:.3f})", flush=True)
    return out
