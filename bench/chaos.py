"""Kill -9 anywhere, lose nothing (issue 20): every stage's command is SIGKILLed at seeded random moments,
run again (the CLI's resume path), and the result compared with an uninterrupted run of the same command.

    python bench/chaos.py --kills 5 --seed 0 --work /tmp/chaos          # scripts/chaos.sh runs this
    python bench/chaos.py --kills 1 --stages sft,synth                  # a quick check

Stages, each on a tiny model / small task set (one torch thread, so every number is reproducible):

    sft     `k3post sft`  (checkpoint every 3 steps, keep_last 2, a metrics row every 2: resumes land between rows)
    rl      `k3post rl`   (λ = 0.5, 3 slots for 6 samples, a KV pool: paused trajectories and pool tensors
            are in each checkpoint; the uninterrupted run must have paused some)
    mopd    `k3post mopd` (one teacher)
    synth   `k3post synth` (several families, every effort; raw file appended sample by sample)
    review  `k3post review accept|reject|edit` over a queue, one command per decision (`edit` through a
            scripted $EDITOR); a killed command is rerun, and "already decided" is its answer once it landed

Kill moments: before each attempt the harness estimates the time the command still needs (the
uninterrupted run's time to its first checkpoint, plus the rest scaled by the work left on disk) and kills
after a delay drawn uniformly from [0, that estimate), so kills land in start-up, in steps and in
checkpoint writes alike. After `--kills` kills the command runs to the end. Compared: the final weights
(bit-identical), the stage's metrics rows (all but wall-clock fields), and for synth / review that every
sample, queue item and decision is present exactly once and equal to the uninterrupted run's. A stage whose
command ends before a drawn kill gets another round from scratch until it has `--kills` kills.

Prints one line per kill and a JSON summary (kills, rounds and seconds per stage); exits 1 on a mismatch.
Stops by itself: `--budget-s` bounds the whole run (default 1800 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES = ("sft", "rl", "mopd", "synth", "review")
_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=64)
_SYNTH_FAMILIES = "general.arithmetic,general.writing,agents.search"
_WALL_KEYS = ("time", "tokens_per_s")  # metrics fields that measure wall-clock time


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3post", *args]


# --------------------------------------------------------------------------- fixtures


def prepare(work: Path, *, model_too: bool = True) -> dict[str, Path]:
    """SFT data (whose raw samples also fill the review queues) and, with ``model_too``, a tokenizer + tiny
    Qwen3-MoE folder; made once per work folder."""
    import torch

    from k3post.stages.sft_data import default_corpus
    from k3post.models import build_tiny_moe, save_model
    from k3post.synth.pipeline import build_sft_dataset
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if model_too and not (model / "config.json").is_file():
        torch.set_num_threads(1)
        tok = train_tokenizer(default_corpus(1, n_main=10), vocab_size=320)
        save_model(build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id,
                                  **_TINY), model, tok)
    data = work / "data" / "sft.jsonl"
    if not data.is_file():
        build_sft_dataset(["general.arithmetic"], ["low", "high", "max"], 8, 0, data)
    return {"model": model, "data": data}


# --------------------------------------------------------------------------- stages


@dataclass
class Stage:
    """One command under chaos: ``argv(run)`` runs it into folder ``run``; ``progress(run)`` is the share
    of its work on disk (0..1); ``compare(ref, run)`` lists the differences from the uninterrupted run."""

    name: str
    argv: Callable[[Path], list[str]]
    progress: Callable[[Path], float]
    compare: Callable[[Path, Path], list[str]]
    setup: Callable[[Path], None] = lambda run: None


def _ckpt_progress(ckpts: str, steps: int) -> Callable[[Path], float]:
    def progress(run: Path) -> float:
        from k3post.checkpoint import latest_checkpoint

        c = latest_checkpoint(run / ckpts)
        return 0.0 if c is None else int(c.name.split("-")[1]) / steps

    return progress


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _metrics(run: Path, stage: str) -> list[dict[str, Any]]:
    from k3post.metrics import read_metrics

    return [{k: v for k, v in r.items() if k not in _WALL_KEYS and not k.endswith("_s")}
            for r in read_metrics(run / "metrics.jsonl", stage)]


def _compare_training(final: str, stage: str, ckpts: str, keep_last: int) -> Callable[[Path, Path], list[str]]:
    def compare(ref: Path, run: Path) -> list[str]:
        import torch

        bad = []
        a, b = _weights(ref / final), _weights(run / final)
        if a.keys() != b.keys() or not a:
            bad.append(f"{final}: tensor names differ or no weights")
        bad += [f"{final}: tensor {k} differs" for k in sorted(a.keys() & b.keys()) if not torch.equal(a[k], b[k])][:5]
        ma, mb = _metrics(ref, stage), _metrics(run, stage)
        if ma != mb:
            steps_b = [r["step"] for r in mb]
            first = next((i for i, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))
            bad.append(f"metrics of {stage}: {len(ma)} rows vs {len(mb)} (steps {steps_b}); first difference at row {first}"
                       + (f": {ma[first]} vs {mb[first]}" if first < min(len(ma), len(mb)) else ""))
        left = sorted(p.name for p in (run / ckpts).iterdir())
        if len([n for n in left if n.startswith("step-")]) > keep_last or any(n.startswith(".tmp") for n in left):
            bad.append(f"{ckpts}: {left} (keep_last {keep_last}, no temp folders expected)")
        return bad

    return compare


def _sft_stage(fx: dict[str, Path], steps: int) -> Stage:
    def argv(run: Path) -> list[str]:
        return _cli("sft", str(run / "sft.yaml"))

    def setup(run: Path) -> None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "sft.yaml").write_text(
            f"run: {{root: {run.parent}, name: {run.name}, seed: 0}}\nmodel: {{path: {fx['model']}}}\nqat: {{enabled: false}}\n"
            f"sft: {{train_file: {fx['data']}, steps: {steps}, rows_per_batch: 2, pack_len: 256, save_every: 3, "
            "keep_last: 2, log_every: 2, warmup_steps: 2, lr: 3.0e-3, progress: false}\n")

    return Stage("sft", argv, _ckpt_progress("sft/checkpoints", steps),
                 _compare_training("sft/final", "sft", "sft/checkpoints", 2), setup)


def _rl_overrides(steps: int) -> list[str]:
    return [f"rl.steps={steps}", "rl.n_tasks=4", "rl.rollout.n_prompts=3", "rl.rollout.k=2", "rl.rollout.slots=3", "rl.eval_n=2", "rl.rollout.max_tokens=24",
            "rl.eval_max_tokens=8", "rl.rollout.lambda_=0.5", "rl.rollout.kv_pool_mb=4", "rl.save_every=1", "rl.keep_last=2",
            "rl.families=[general.arithmetic]", "rl.progress=false", "rl.optim.lr=1e-3", "qat.enabled=false",
            "rl.effort_control.b0_samples=1",
            # general and general.max's own settings (GENERAL_MAX_SETTING: 32 prompts on-policy, 256 slots, avg@8) back
            # to this stage's: 3 slots for 6 samples at λ = 0.5 pause some of them
            "rl.domain_overrides.general.n_tasks=4", "rl.domain_overrides.general.eval_n=2",
            "rl.domain_overrides.general.rollout.slots=3", "rl.domain_overrides.general.max.rollout.n_prompts=3",
            "rl.domain_overrides.general.max.rollout.lambda_=0.5", "rl.domain_overrides.general.max.rollout.max_staleness=4",
            "rl.domain_overrides.general.max.optim.lr=1e-3", "rl.domain_overrides.general.max.optim.lr_schedule=constant",
            "rl.domain_overrides.general.max.eval_samples=0"]


def _rl_stage(fx: dict[str, Path], steps: int, init: Path) -> Stage:
    def argv(run: Path) -> list[str]:
        return _cli("rl", str(run / "rl.yaml"), f"rl.init={init}", *_rl_overrides(steps))

    def setup(run: Path) -> None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "rl.yaml").write_text(f"run: {{root: {run.parent}, name: {run.name}}}\n")

    ck = "rl/general.max/checkpoints"
    same = _compare_training("rl/general.max/final", "rl/general.max", ck, 2)

    def compare(ref: Path, run: Path) -> list[str]:  # 3 slots for 6 samples, λ = 0.5: some are always paused
        paused = sum(r["paused"] for r in _metrics(ref, "rl/general.max"))
        return same(ref, run) + ([] if paused > 0 else ["nothing was paused: the partial-rollout state went untested"])

    return Stage("rl", argv, _ckpt_progress(ck, steps), compare, setup)


def _mopd_stage(fx: dict[str, Path], steps: int, init: Path) -> Stage:
    # the RL stage's settings as MOPD's (``mopd.rl.*`` on the command line, where the loader takes dotted keys)
    rl = [f"mopd.{o}" for o in _rl_overrides(steps)
          if o.startswith("rl.") and not o.startswith(("rl.effort_control", "rl.families"))]

    def argv(run: Path) -> list[str]:
        return _cli("mopd", str(run / "mopd.yaml"), f"rl.init={init}", *rl)

    def setup(run: Path) -> None:
        run.mkdir(parents=True, exist_ok=True)
        (run / "mopd.yaml").write_text(
            f"run: {{root: {run.parent}, name: {run.name}}}\nqat: {{enabled: false}}\n"
            f"mopd:\n  experts: {{general.max: {fx['model']}}}\n  effort_mix: {{low: 0.0, high: 0.0, max: 1.0}}\n  domains: [general]\n"
            f"  families: {{general: [general.arithmetic]}}\n  max_resident: 1\n")

    return Stage("mopd", argv, _ckpt_progress("mopd/checkpoints", steps),
                 _compare_training("mopd/final", "mopd", "mopd/checkpoints", 2), setup)


def _synth_stage(n: int) -> Stage:
    total = n * len(_SYNTH_FAMILIES.split(",")) * 3

    def argv(run: Path) -> list[str]:
        return _cli("synth", "--family", _SYNTH_FAMILIES, "--effort", "all", "--n", str(n), "--out", str(run / "sft.jsonl"))

    def progress(run: Path) -> float:
        raw = run / "sft.raw.jsonl"
        return raw.read_bytes().count(b"\n") / total if raw.exists() else 0.0

    def compare(ref: Path, run: Path) -> list[str]:
        from k3post.io import read_jsonl

        bad = []
        for name in ("sft.raw.jsonl", "sft.jsonl", "sft.rejected.jsonl"):
            a, b = read_jsonl(ref / name), read_jsonl(run / name)
            ids = [r["id"] for r in b]
            dup = sorted({i for i in ids if ids.count(i) > 1})
            if dup:
                bad.append(f"{name}: ids written more than once: {dup[:5]}")
            if sorted(ids) != sorted(r["id"] for r in a):
                bad.append(f"{name}: {len(b)} samples vs {len(a)} uninterrupted")
            elif {r["id"]: r for r in a} != {r["id"]: r for r in b}:
                bad.append(f"{name}: sample contents differ")
        qa, qb = (sorted(p.name for p in (d / "sft.review" / "items").glob("*.json")) for d in (ref, run))
        if qa != qb:
            bad.append(f"review queue items differ: {len(qb)} vs {len(qa)}")
        if (ref / "sft.jsonl").read_bytes() != (run / "sft.jsonl").read_bytes():
            bad.append("sft.jsonl differs byte for byte")
        return bad

    return Stage("synth", argv, progress, compare)


# --------------------------------------------------------------------------- the kill loop


@dataclass
class Report:
    kills: int = 0
    rounds: int = 0
    seconds: float = 0.0
    ref_seconds: float = 0.0
    kill_progress: list[float] = field(default_factory=list)  # share of the work on disk at each kill
    mismatches: list[str] = field(default_factory=list)


def _run(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True)


def _killed_after(p: subprocess.Popen, delay: float) -> bool:
    """SIGKILL ``p`` (and any worker it started) after ``delay`` seconds unless it ended first; True if killed."""
    try:
        p.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return True


def reference(stage: Stage, ref: Path) -> tuple[float, float]:
    """Run ``stage`` uninterrupted into ``ref``; returns (seconds, seconds until its first progress)."""
    stage.setup(ref)
    t0 = time.monotonic()
    p = _run(stage.argv(ref), ref / "chaos.log")
    first = None
    while p.poll() is None:
        if first is None and stage.progress(ref) > 0:
            first = time.monotonic() - t0
        time.sleep(0.05)
    total = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{stage.name}: the uninterrupted run failed (exit {p.returncode}); see {ref / 'chaos.log'}")
    return total, first if first is not None else total / 2


def chaos(stage: Stage, ref: Path, work: Path, kills: int, rng: random.Random, deadline: float) -> Report:
    """Kill ``stage`` ``kills`` times at random moments, finish it, compare with ``ref`` (module doc)."""
    rep = Report()
    t_start = time.monotonic()
    rep.ref_seconds, t_first = reference(stage, ref)
    while rep.kills < kills:
        run = work / f"{stage.name}-chaos-{rep.rounds}"
        shutil.rmtree(run, ignore_errors=True)
        stage.setup(run)
        rep.rounds += 1
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stage.name}: out of time after {rep.kills} kills")
            done = stage.progress(run)
            est = t_first + (rep.ref_seconds - t_first) * max(0.0, 1.0 - done)
            p = _run(stage.argv(run), run / "chaos.log")
            if rep.kills < kills:
                delay = rng.uniform(0.0, est)
                if _killed_after(p, delay):
                    rep.kills += 1
                    rep.kill_progress.append(round(stage.progress(run), 3))
                    print(f"  {stage.name}: kill {rep.kills} at {delay:.1f} s of ~{est:.1f} s (work on disk {done:.0%})", flush=True)
                    continue
            else:
                p.wait()
            break
        if p.returncode != 0:
            rep.mismatches.append(f"{run}: the resumed command failed (exit {p.returncode}); see {run / 'chaos.log'}")
            break
        rep.mismatches += [f"round {rep.rounds}: {m}" for m in stage.compare(ref, run)]
    rep.seconds = time.monotonic() - t_start
    return rep


# --------------------------------------------------------------------------- review


def _editor(work: Path) -> Path:
    """A scripted $EDITOR: appends a sentence to the last assistant turn's thinking (the outcome is unchanged)."""
    ed = work / "editor.py"
    ed.write_text("import json, sys\np = sys.argv[1]\nm = json.load(open(p))\n"
                  "a = [x for x in m if x.get('role') == 'assistant'][-1]\n"
                  "a['reasoning_content'] = (a.get('reasoning_content') or '') + ' Checked by a reviewer.'\n"
                  "json.dump(m, open(p, 'w'))\n")
    return ed


def _review_queue(fx: dict[str, Path], q: Path, n: int) -> list[tuple[str, str]]:
    """A queue of ``n`` flagged samples and the decisions to take: accept, reject, edit in turn."""
    from k3post.io import read_jsonl
    from k3post.synth.review import ReviewQueue

    raw = read_jsonl(fx["data"].with_name("sft.raw.jsonl"))[:n]
    queue = ReviewQueue(q)
    for s in raw:
        queue.add(s, [{"stage": "quality", "status": "uncertain", "reason": "chaos", "detail": "test"}])
    return [(s["id"], ("accept", "reject", "edit")[i % 3]) for i, s in enumerate(raw)]


def _review_argv(q: Path, item: str, decision: str) -> list[str]:
    extra = ["--note", "chaos"] if decision != "accept" else []
    return _cli("review", decision, item, "--queue", str(q), "--reviewer", "chaos", *extra)


def _review_state(q: Path) -> tuple[dict[str, list[str]], dict[str, Any]]:
    from k3post.synth.review import ReviewQueue

    queue = ReviewQueue(q)
    by_id: dict[str, list[str]] = {}
    for d in queue.log():
        by_id.setdefault(d["id"], []).append(d["decision"])
    return by_id, {it["id"]: (it["status"], it["sample"]) for it in queue.items()}


def review_chaos(fx: dict[str, Path], work: Path, kills: int, n: int, rng: random.Random, deadline: float) -> Report:
    """Decide ``n`` items with one `k3post review` command each, uninterrupted and with kills; every command
    that was killed is rerun until it answers 0 or "already decided" (2); then each item must hold exactly
    one decision, of the intended kind, and the same status and sample as uninterrupted."""
    rep = Report()
    t_start = time.monotonic()
    os.environ["EDITOR"] = f"{sys.executable} {_editor(work)}"
    ref = work / "review-ref"
    shutil.rmtree(ref, ignore_errors=True)
    plan = _review_queue(fx, ref, n)
    times = []
    for item, decision in plan:
        t0 = time.monotonic()
        if subprocess.run(_review_argv(ref, item, decision), env=_env(), capture_output=True).returncode != 0:
            raise RuntimeError(f"review {decision} {item} failed uninterrupted")
        times.append(time.monotonic() - t0)
    rep.ref_seconds = sum(times)
    ref_log, ref_items = _review_state(ref)
    while rep.kills < kills:
        q = work / f"review-chaos-{rep.rounds}"
        shutil.rmtree(q, ignore_errors=True)
        _review_queue(fx, q, n)
        rep.rounds += 1
        for (item, decision), t_ref in zip(plan, times):
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"review: out of time after {rep.kills} kills")
                p = _run(_review_argv(q, item, decision), work / "review.log")
                if rep.kills < kills and rng.random() < 0.7:
                    delay = rng.uniform(0.0, t_ref)
                    if _killed_after(p, delay):
                        rep.kills += 1
                        print(f"  review: kill {rep.kills} of `{decision} {item}` at {delay:.2f} s of ~{t_ref:.2f} s", flush=True)
                        continue
                p.wait()
                if p.returncode not in (0, 2):
                    rep.mismatches.append(f"review {decision} {item}: exit {p.returncode}")
                break
        got_log, got_items = _review_state(q)
        for item, decision in plan:
            want = ["edit" if decision == "edit" else decision]
            if got_log.get(item) != want:
                rep.mismatches.append(f"round {rep.rounds}: {item}: decisions {got_log.get(item)}, expected {want}")
        if got_items != ref_items:
            diff = sorted(k for k in ref_items if got_items.get(k) != ref_items[k])
            rep.mismatches.append(f"round {rep.rounds}: items differ from uninterrupted: {diff[:5]}")
        assert ref_log == {i: ["edit" if d == "edit" else d] for i, d in plan}
    rep.seconds = time.monotonic() - t_start
    return rep


# --------------------------------------------------------------------------- main


def run_chaos(work: Path, stages: list[str], kills: int, seed: int, budget_s: float, *, sft_steps: int = 12,
              rl_steps: int = 5, synth_n: int = 3, review_n: int = 6) -> dict[str, Any]:
    """Every stage in ``stages`` under ``kills`` kills (module doc); returns the summary."""
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; expected some of {STAGES}")
    deadline = time.monotonic() + budget_s
    fx = prepare(work, model_too=bool({"sft", "rl", "mopd"} & set(stages)))
    rng = random.Random(seed)
    summary: dict[str, Any] = {"kills_per_stage": kills, "seed": seed, "stages": {}}
    init = work / "ref-sft" / "sft" / "final"
    for name in stages:
        print(f"{name}:", flush=True)
        if name == "review":
            rep = review_chaos(fx, work, kills, review_n, rng, deadline)
        else:
            if name in ("rl", "mopd") and not (init / "config.json").is_file():
                st = _sft_stage(fx, sft_steps)
                shutil.rmtree(work / "ref-sft", ignore_errors=True)
                reference(st, work / "ref-sft")
            stage = {"sft": lambda: _sft_stage(fx, sft_steps), "rl": lambda: _rl_stage(fx, rl_steps, init),
                     "mopd": lambda: _mopd_stage(fx, rl_steps, init), "synth": lambda: _synth_stage(synth_n)}[name]()
            ref = work / f"ref-{name}"
            shutil.rmtree(ref, ignore_errors=True)
            rep = chaos(stage, ref, work, kills, rng, deadline)
        summary["stages"][name] = {"kills": rep.kills, "rounds": rep.rounds, "seconds": round(rep.seconds, 1),
                                   "uninterrupted_s": round(rep.ref_seconds, 1), "work_on_disk_at_kill": rep.kill_progress,
                                   "mismatches": rep.mismatches}
        print(f"  {name}: {rep.kills} kills in {rep.rounds} round(s), {rep.seconds:.0f} s; "
              + ("identical to the uninterrupted run" if not rep.mismatches else f"MISMATCH: {rep.mismatches}"), flush=True)
    summary["ok"] = not any(s["mismatches"] for s in summary["stages"].values())
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/k3post-chaos", help="scratch folder (reused: the tiny model is kept)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--kills", type=int, default=5, help="kills per stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=1800.0, help="stop (exit 1) after this long")
    ns = ap.parse_args(argv)
    summary = run_chaos(Path(ns.work), [s for s in ns.stages.split(",") if s], ns.kills, ns.seed, ns.budget_s)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
