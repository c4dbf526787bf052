"""SFT data synthesis: teacher trajectories → verification funnel → review queue → SFT JSONL.

    path, funnel = build_sft_dataset(None, ["low", "high", "max"], n_per=8, seed=0, out="data/sft.jsonl")
    print(funnel.table())

One loop, stage by stage: for each family and effort, `synthesize` runs the teacher's policy on
``family.generate(n, seed)`` tasks through the family's environment and appends every trajectory
(kept or not) to a raw JSONL file as soon as it finishes; `verify_samples` runs the stages of
`k3post.synth.verify`; kept samples (plus any the review queue has accepted) are written to the
SFT file atomically, uncertain ones go to the review queue, rejected ones to ``*.rejected.jsonl``
with their reason.

A **raw sample** (one JSON line of the raw file) is the SFT record plus provenance::

    {"id": "s-3f9a0c21be47", "messages": [...], "tools": [...] | null, "effort": "high",
     "family": "general.arithmetic", "domain": "general", "teacher": "reference", "seed": 0,
     "difficulty": 1, "task_id": "arith-0-d1-00003", "task": {Task.to_dict()},
     "tokens": {"reasoning": 12, "output": 20, "total": 95, "method": "xtml" | "words"},
     "verdict": {"reward": 1.0, "components": {...}, "diagnostics": "..."} | null,
     "turns": 1, "truncated": false, "truncation": null, "error": null}

``messages`` is the full trajectory (prompt, assistant turns, tool results from the environment).
Token counts: with the run's tokenizer (``method: "xtml"``) ``output`` is the number of trainable
XTML tokens (SPEC §1.5 loss mask), ``reasoning`` the tokens of the think channels and ``total``
the rendered length; without one (``"words"``) they are whitespace-word counts, the approximation
`k3post.envs.count_tokens` uses, with a teacher-reported ``num_tokens`` taking precedence for a
message's output tokens.

The SFT file keeps the SFT keys (``messages``, ``tools``, ``effort``) plus flat provenance
(``id``, ``family``, ``domain``, ``teacher``, ``seed``, ``difficulty``, ``task_id``, ``tokens``,
``reward``), which ``k3post sft`` ignores. It is also a plain JSON-lines dataset for Hugging Face
``datasets``::

    from datasets import load_dataset
    ds = load_dataset("json", data_files="data/sft.jsonl", split="train")
    ds[0]["messages"]            # list of {"role", "content", "reasoning_content", "tool_calls", ...}

(Arrow unifies the message dicts into one struct type, filling missing keys with None; the
``tools`` column holds JSON Schemas, so keep families with conflicting schema value types in
separate files, or load with ``features=`` given explicitly.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3post.envs.episode import run_episode
from k3post.envs.task import Task
from k3post.io import atomic_write, read_jsonl, write_jsonl
from k3post.synth.samples import (builtin_families, count_sample_tokens, find_family, replay_sample,
                                  resolve_families, sample_id, sft_record)
from k3post.synth.review import ReviewQueue
from k3post.synth.teachers import EFFORTS, ReferenceTeacher, Teacher
from k3post.synth.verify import Funnel, Judge, VerifyConfig, VerifyContext, verify_samples

__all__ = [
    "SynthConfig",
    "find_family",
    "builtin_families",
    "count_sample_tokens",
    "sample_id",
    "asynthesize",
    "synthesize",
    "replay_sample",
    "sft_record",
    "verify_and_route",
    "build_sft_dataset",
    "synth_from_config",
]

log = logging.getLogger("k3post.synth")

@dataclass
class SynthConfig:
    """The ``synth`` config section: what `build_sft_dataset` synthesizes and how it filters and mixes.

    Attributes:
        families: family names; empty means every built-in family.
        efforts: effort levels, each task is solved at every one.
        n_per: tasks per family (the same tasks at every effort).
        difficulty: task difficulty passed to ``family.generate`` (clipped to the family's maximum).
        verify: stage thresholds (`VerifyConfig`).
        mix_weights: ``domain/effort`` (or ``domain``, ``*/effort``, ``*``) → weight for `k3post.synth.mix.mix`.
        mix_n: samples in the mixed dataset; 0 keeps every sample unweighted (no mixing).
    """

    families: list[str] = field(default_factory=list)
    efforts: list[str] = field(default_factory=lambda: list(EFFORTS))
    n_per: int = 8
    difficulty: int = 1
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    mix_weights: dict[str, float] = field(default_factory=dict)
    mix_n: int = 0


async def _one(teacher: Teacher, family: Any, task: Task, effort: str, seed: int, difficulty: int, xtml: Any) -> dict[str, Any]:
    sid = sample_id(teacher.name, family.name, task.id, effort, seed, difficulty)
    base = {"id": sid, "effort": effort, "family": family.name, "domain": family.domain, "teacher": teacher.name,
            "seed": seed, "difficulty": difficulty, "task_id": task.id, "task": task.to_dict()}
    try:
        ep = await run_episode(teacher.policy(task, effort), family.make_env(task), task)
    except Exception as e:  # noqa: BLE001 - a failed episode is recorded (and rejected), not fatal
        log.warning("%s on %s (%s): %s: %s", teacher.name, task.id, effort, type(e).__name__, e)
        msgs = task.prompt()
        return {**base, "messages": msgs, "tools": [t.to_openai() for t in task.tools] or None,
                "tokens": count_sample_tokens(msgs, None, effort, xtml), "verdict": None, "turns": 0,
                "truncated": False, "truncation": None, "error": f"{type(e).__name__}: {e}"}
    tools = ep.tools or None
    return {**base, "messages": ep.messages, "tools": tools, "tokens": count_sample_tokens(ep.messages, tools, effort, xtml),
            "verdict": None if ep.verdict is None else ep.verdict.to_dict(), "turns": ep.turns,
            "truncated": ep.truncated, "truncation": ep.truncation, "error": None}


def _done_samples(raw: Path) -> dict[str, dict[str, Any]]:
    """Samples already in a raw file, by id (a torn last line from a crash is dropped)."""
    return {r["id"]: r for r in read_jsonl(raw, repair=True) if "id" in r} if raw.exists() else {}


async def asynthesize(
    family: Any,
    teacher: Teacher,
    *,
    effort: str,
    n: int,
    seed: int = 0,
    difficulty: int = 1,
    out: str | Path | None = None,
    tokenizer: Any = None,
    tasks: Sequence[Task] | None = None,
    done: Mapping[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Async `synthesize`: up to ``teacher.concurrency`` episodes at once.

    A teacher with ``threaded = True`` (the reference solver) runs each episode in a worker
    thread with its own event loop, because environments may block (sandboxed code runs in
    subprocesses); others (endpoints) overlap on this loop.
    """
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    difficulty = min(difficulty, int(getattr(family, "max_difficulty", difficulty)))
    tasks = list(tasks) if tasks is not None else family.generate(n, seed=seed, difficulty=difficulty)
    xtml = None
    if tokenizer is not None:
        from k3post.xtml import XTML

        xtml = XTML(tokenizer)
    fh = None
    if out is not None:
        p = Path(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        if done is None:
            done = _done_samples(p)
        fh = p.open("a", encoding="utf-8")
    done = done or {}
    results: dict[int, dict[str, Any]] = {}
    sem = asyncio.Semaphore(max(1, int(getattr(teacher, "concurrency", 1))))

    async def work(k: int, task: Task) -> None:
        sid = sample_id(teacher.name, family.name, task.id, effort, seed, difficulty)
        if sid in done:  # resumed: already written by an earlier (possibly crashed) run
            results[k] = done[sid]
            return
        async with sem:
            if getattr(teacher, "threaded", False):  # blocking envs (sandboxes): one thread + loop per episode
                rec = await asyncio.to_thread(lambda: asyncio.run(_one(teacher, family, task, effort, seed, difficulty, xtml)))
            else:
                rec = await _one(teacher, family, task, effort, seed, difficulty, xtml)
        results[k] = rec
        if fh is not None:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()

    try:
        await asyncio.gather(*(work(k, t) for k, t in enumerate(tasks)))
    finally:
        if fh is not None:
            fh.close()
    return [results[k] for k in range(len(tasks))]


def synthesize(
    family: Any,
    teacher: Teacher | None = None,
    *,
    effort: str,
    n: int,
    seed: int = 0,
    difficulty: int = 1,
    out: str | Path | None = None,
    tokenizer: Any = None,
    tasks: Sequence[Task] | None = None,
    done: Mapping[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Trajectories of ``teacher`` (default: the family's reference solver) on ``n`` tasks at ``effort``.

    Args:
        family: a TaskFamily or its name.
        teacher: a `Teacher` (`ReferenceTeacher`, `EndpointTeacher`, `LocalModelTeacher`).
        effort: ``low`` | ``high`` | ``max``.
        n: tasks, ``family.generate(n, seed=seed, difficulty=difficulty)`` (unless ``tasks`` is given).
        out: raw JSONL file; each sample is appended and flushed as soon as its episode ends,
            and samples already in the file (same id) are not redone, so a crashed run resumes.
        tokenizer: the run's tokenizer for exact token counts (else word counts).
        tasks: the tasks to solve instead of generating ``n``.
        done: samples already written, by id (default: read from ``out``).

    Returns:
        The raw samples, in task order (see the module docstring for the format). A teacher that
        fails on a task (e.g. an endpoint still down after its retries) gives a sample with
        ``error`` set, which the structure stage rejects.
    """
    fam = find_family(family) if isinstance(family, str) else family
    t = teacher or ReferenceTeacher(fam)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(
            asynthesize(fam, t, effort=effort, n=n, seed=seed, difficulty=difficulty, out=out, tokenizer=tokenizer, tasks=tasks, done=done)
        )
    raise ValueError("synthesize() cannot run inside an event loop; await asynthesize() instead")


# --------------------------------------------------------------------------- the whole pipeline


def _sibling(out: Path, suffix: str) -> Path:
    """``data/sft.jsonl`` + ``.raw.jsonl`` → ``data/sft.raw.jsonl``."""
    return out.with_name(out.stem + suffix)


def verify_and_route(
    samples: Sequence[Mapping[str, Any]],
    out: str | Path,
    *,
    ctx: VerifyContext,
    review_dir: str | Path | None = None,
) -> tuple[Path, Funnel]:
    """Verify ``samples``; write kept (+ review-accepted) samples to ``out``, queue uncertain ones,
    log rejected ones to ``<out>.rejected.jsonl`` and the funnel to ``<out>.funnel.json``."""
    outp = Path(out)
    rep = verify_samples(samples, ctx)
    queue = ReviewQueue(review_dir if review_dir is not None else _sibling(outp, ".review"))
    for s, flags in rep.uncertain:
        queue.add(s, flags)
    accepted = queue.accepted_samples()
    kept_ids = {s["id"] for s in rep.kept}
    records = [sft_record(s) for s in rep.kept] + [sft_record(s) for s in accepted if s.get("id") not in kept_ids]
    write_jsonl(outp, records)
    write_jsonl(
        _sibling(outp, ".rejected.jsonl"),
        [{"id": s.get("id"), "family": s.get("family"), "effort": s.get("effort"), "rejected_by": f, "messages": s.get("messages")} for s, f in rep.rejected],
    )
    summary = rep.funnel.to_dict()
    summary["review_queue"] = str(queue.root)
    summary["queued"] = len(rep.uncertain)
    summary["accepted_from_review"] = len(records) - len(rep.kept)
    summary["written"] = len(records)
    funnel_path = _sibling(outp, ".funnel.json")
    atomic_write(funnel_path, json.dumps(summary, indent=1, ensure_ascii=False))
    return outp, rep.funnel


def build_sft_dataset(
    families: Sequence[Any] | None,
    efforts: Sequence[str],
    n_per: int,
    seed: int,
    out: str | Path,
    tokenizer: Any = None,
    *,
    teacher: Callable[[Any], Teacher] | None = None,
    difficulty: int = 1,
    config: VerifyConfig | None = None,
    judges: Mapping[str, Judge] | None = None,
    review_dir: str | Path | None = None,
    raw_out: str | Path | None = None,
    deal: bool = False,
) -> tuple[Path, Funnel]:
    """Synthesize, verify and write an SFT dataset over ``families`` × ``efforts``.

    Args:
        families: TaskFamily objects or names; None or empty: every built-in family.
        efforts: effort levels (each of the ``n_per`` tasks of a family is solved at each).
        n_per: tasks per family.
        seed: task generation seed (the same tasks at every effort).
        out: the SFT JSONL to write (atomically); next to it: ``<stem>.raw.jsonl`` (every
            trajectory, appended as produced; a rerun resumes from it), ``<stem>.rejected.jsonl``,
            ``<stem>.funnel.json`` and the review queue ``<stem>.review/``.
        tokenizer: the run's tokenizer (exact token counts, XTML checks with the real vocabulary).
        teacher: ``family -> Teacher`` (default `ReferenceTeacher`).
        difficulty, config, judges, review_dir, raw_out: see `synthesize`, `VerifyConfig`,
            `VerifyContext`; ``raw_out`` overrides the raw file path.
        deal: the tasks are dealt to the efforts in turn (task i is solved at ``efforts[i % len(efforts)]``
            only) instead of each task at every effort.

    Returns:
        ``(out path, funnel)``; ``funnel.table()`` prints the per-stage counts.
    """
    fams = resolve_families(families)
    for e in efforts:
        if e not in EFFORTS:
            raise ValueError(f"efforts: unknown effort {e!r}; expected some of {EFFORTS}")
    outp = Path(out)
    raw = Path(raw_out) if raw_out is not None else _sibling(outp, ".raw.jsonl")
    make_teacher = teacher or ReferenceTeacher
    samples: list[dict[str, Any]] = []
    done = _done_samples(raw)
    t0 = time.perf_counter()
    for fam in fams:
        d = min(difficulty, int(getattr(fam, "max_difficulty", difficulty)))
        tasks = fam.generate(n_per, seed=seed, difficulty=d)
        tch = make_teacher(fam)
        for j, e in enumerate(efforts):
            mine = list(tasks[j::len(efforts)]) if deal else tasks
            samples += synthesize(fam, tch, effort=e, n=len(mine), seed=seed, difficulty=d, out=raw, tokenizer=tokenizer, tasks=mine, done=done)
    log.info("synthesized %d trajectories in %.1f s", len(samples), time.perf_counter() - t0)
    ctx = VerifyContext(config, tokenizer=tokenizer, judges=judges)
    return verify_and_route(samples, outp, ctx=ctx, review_dir=review_dir)


def synth_from_config(
    cfg: SynthConfig, out: str | Path, *, seed: int = 0, tokenizer: Any = None, review_dir: str | Path | None = None
) -> tuple[Path, Funnel]:
    """`build_sft_dataset` driven by a `SynthConfig` (the ``synth`` config section), then, when
    ``mix_weights`` or ``mix_n`` is set, the SFT file is replaced by its `k3post.synth.mix.mix`
    (weights by ``domain/effort``, ``mix_n`` samples, seeded). The raw file, funnel and review
    queue are those of the unmixed data, so a rerun re-derives the same mix."""
    from k3post.synth.mix import mix

    path, funnel = build_sft_dataset(
        cfg.families or None, cfg.efforts, cfg.n_per, seed, out, tokenizer, difficulty=cfg.difficulty, config=cfg.verify,
        review_dir=review_dir,
    )
    if cfg.mix_weights or cfg.mix_n:
        write_jsonl(path, mix(read_jsonl(path), cfg.mix_weights, cfg.mix_n or None, seed))
    return path, funnel
