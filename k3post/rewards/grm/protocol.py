"""The GRM judge's protocol (SPEC §3.4): the judge task, `GRMJudgeEnv` and its four tools, and the verifier
that decides whether a judgement is valid (`judgement_check`). See `k3post.rewards.grm` for the whole design."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.task import DOMAINS, FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

SCORE_MAX = 10.0
"""Per-criterion scores lie in [0, SCORE_MAX] (ours)."""

TOTAL_TOL = 0.01
"""Default absolute tolerance of a scorepad total against Σ weight · score (ours)."""

JUDGE_VERIFIER = "grm.judgement"
"""Verifier name of judge tasks (`judgement_check` on the final judge-env state)."""

LABELS = "ABCDEFGH"


# =========================================================================== the judge environment


@dataclass(frozen=True)
class Candidate:
    """One candidate of a K-group: its final response, optional artifacts, and its length.

    Attributes:
        text: the final response (what ``read_candidate`` shows first).
        artifacts: named artifacts (file name -> content) also shown by ``read_candidate``.
        length: size for the length guard, in ℓ0's unit (tokens from the rollout); None: the
            number of whitespace-separated words of ``text``.
    """

    text: str
    artifacts: Mapping[str, str] = field(default_factory=dict)
    length: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ValueError(f"Candidate.text must be a string, got {type(self.text).__name__}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.artifacts).items()):
            raise ValueError("Candidate.artifacts must map names to strings")
        object.__setattr__(self, "artifacts", dict(self.artifacts))
        if self.length is not None and (isinstance(self.length, bool) or not self.length >= 0):
            raise ValueError(f"Candidate.length must be a number >= 0 or None, got {self.length!r}")

    @property
    def size(self) -> float:
        """``length``, or the word count of ``text``."""
        return float(self.length) if self.length is not None else float(len(self.text.split()))


def _as_candidate(c: Candidate | str) -> Candidate:
    if isinstance(c, Candidate):
        return c
    if isinstance(c, str):
        return Candidate(c)
    raise ValueError(f"a candidate must be a Candidate or a string, got {type(c).__name__}")


_SYSTEM = (
    "You are a judge. Compare the candidate answers to the request below by following this protocol "
    "with your tools; a judgement that skips a step is discarded.\n"
    "1. read_candidate: read every candidate.\n"
    "2. write_rubric: the criteria that matter for this request, each with a positive weight.\n"
    f"3. score: score every candidate on every criterion, from 0 to {SCORE_MAX:g}.\n"
    "4. scorepad: record each candidate's total = sum over criteria of weight * score. "
    "Only the scorepad counts; anything else you write is ignored."
)


def judge_task(
    prompt: str,
    candidates: Sequence[Candidate | str],
    *,
    task_id: str = "grm",
    domain: str = "general",
    total_tol: float = TOTAL_TOL,
) -> Task:
    """The judge's task: the request the candidates answered, and the candidates (hidden).

    The candidates are labelled A, B, ... in the given order; their contents live in the task
    metadata and reach the judge only through ``read_candidate``.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("judge_task needs the request the candidates answered (a non-empty string)")
    cands = [_as_candidate(c) for c in candidates]
    if not 1 <= len(cands) <= len(LABELS):
        raise ValueError(f"a judgement compares 1..{len(LABELS)} candidates, got {len(cands)}")
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if not total_tol >= 0:
        raise ValueError(f"total_tol must be >= 0, got {total_tol!r}")
    labels = list(LABELS[: len(cands)])
    user = f"Request given to the candidates:\n{prompt}\n\nCandidates: {', '.join(labels)}."
    meta = {
        "labels": labels,
        "candidates": {lab: {"response": c.text, "artifacts": dict(c.artifacts)} for lab, c in zip(labels, cands)},
        "total_tol": float(total_tol),
    }
    return Task(task_id, domain, "grm", ({"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}),
                JUDGE_VERIFIER, metadata=meta)


def _labels(ctx: ToolContext) -> list[str]:
    assert ctx.task is not None
    return list(ctx.task.metadata["labels"])


def _log(ctx: ToolContext, *step: Any) -> None:
    ctx.state["log"].append(list(step))


def _read_candidate(ctx: ToolContext, id: str) -> dict[str, Any]:  # noqa: A002 - the tool's argument name
    labels = _labels(ctx)
    if id not in labels:
        raise ValueError(f"unknown candidate {id!r}; the candidates are {', '.join(labels)}")
    assert ctx.task is not None
    cand = ctx.task.metadata["candidates"][id]
    if id not in ctx.state["read"]:
        ctx.state["read"].append(id)
    _log(ctx, "read", id)
    return {"candidate": id, "response": cand["response"], "artifacts": cand["artifacts"]}


def _write_rubric(ctx: ToolContext, criteria: list[dict[str, Any]]) -> str:
    unread = [lab for lab in _labels(ctx) if lab not in ctx.state["read"]]
    if unread:
        raise ValueError(f"protocol step 1 first: read every candidate before the rubric (not read: {', '.join(unread)})")
    if ctx.state["rubric"] is not None:
        raise ValueError("the rubric is already written; score the candidates against it")
    names = [c["name"] for c in criteria]
    if len(set(names)) != len(names):
        raise ValueError(f"criterion names must be distinct, got {names}")
    rubric = [{"name": c["name"], "weight": float(c["weight"])} for c in criteria]
    ctx.state["rubric"] = rubric
    _log(ctx, "rubric", names)
    listed = ", ".join(f"{c['name']} (weight {c['weight']:g})" for c in rubric)
    return f"Rubric recorded: {listed}."


def _score(ctx: ToolContext, candidate: str, scores: dict[str, float]) -> str:
    labels = _labels(ctx)
    if candidate not in labels:
        raise ValueError(f"unknown candidate {candidate!r}; the candidates are {', '.join(labels)}")
    if candidate not in ctx.state["read"]:
        raise ValueError(f"read candidate {candidate} before scoring it")
    rubric = ctx.state["rubric"]
    if rubric is None:
        raise ValueError("protocol step 2 first: write the rubric before scoring")
    names = [c["name"] for c in rubric]
    unknown = [k for k in scores if k not in names]
    if unknown:
        raise ValueError(f"not rubric criteria: {unknown}; the rubric has {names}")
    have = ctx.state["scores"].setdefault(candidate, {})
    again = [k for k in scores if k in have]
    if again:
        raise ValueError(f"candidate {candidate} is already scored on {again}")
    have.update({k: float(v) for k, v in scores.items()})
    _log(ctx, "score", candidate, sorted(scores))
    left = [f"{lab}:{n}" for lab in labels for n in names if n not in ctx.state["scores"].get(lab, {})]
    return "Scores recorded." + (f" Still to score: {', '.join(left)}." if left else " Every candidate is scored; record the scorepad.")


def _scorepad(ctx: ToolContext, scores: dict[str, float]) -> str:
    _log(ctx, "scorepad", sorted(scores))
    return "Scorepad recorded."


_READ = ToolSpec(
    "read_candidate",
    "Read one candidate: its final response and any artifacts.",
    {"type": "object", "properties": {"id": {"type": "string", "description": "candidate label, e.g. A"}},
     "required": ["id"], "additionalProperties": False},
    read_only=True,
    handler=_read_candidate,
)
_RUBRIC = ToolSpec(
    "write_rubric",
    "Write the rubric once, after reading every candidate: criteria with positive weights.",
    {"type": "object", "properties": {"criteria": {
        "type": "array", "minItems": 1, "maxItems": 10,
        "items": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1},
                                                   "weight": {"type": "number", "exclusiveMinimum": 0}},
                  "required": ["name", "weight"]}}},
     "required": ["criteria"], "additionalProperties": False},
    handler=_write_rubric,
)
_SCORE = ToolSpec(
    "score",
    f"Score one candidate on one or more rubric criteria, each from 0 to {SCORE_MAX:g}.",
    {"type": "object", "properties": {
        "candidate": {"type": "string"},
        "scores": {"type": "object", "minProperties": 1,
                   "additionalProperties": {"type": "number", "minimum": 0, "maximum": SCORE_MAX}}},
     "required": ["candidate", "scores"], "additionalProperties": False},
    handler=_score,
)
_SCOREPAD = ToolSpec(
    "scorepad",
    "Record the final totals (sum over criteria of weight * score) of every candidate. Ends the judgement.",
    {"type": "object", "properties": {"scores": {"type": "object", "additionalProperties": {"type": "number"}}},
     "required": ["scores"], "additionalProperties": False},
    handler=_scorepad,
)


def _initial_state(task: Task) -> dict[str, Any]:
    return {"read": [], "rubric": None, "scores": {}, "log": []}


class GRMJudgeEnv(ToolEnvironment):
    """The judge's environment: tools ``read_candidate``, ``write_rubric``, ``score``, ``scorepad``.

    The state records what was read, the rubric, the per-criterion scores and the log of accepted
    steps in order; ``scorepad`` is the submit tool (its arguments are the submission). A plain-text
    answer ends the episode without a scorepad (an invalid judgement). Verified by `judgement_check`.
    """

    def __init__(self, limits: EpisodeLimits | None = None) -> None:
        """Args: limits: per-episode limits (default 12 turns: the protocol needs 1 to 4)."""
        super().__init__(
            [_READ, _RUBRIC, _SCORE, _SCOREPAD],
            initial_state=_initial_state,
            submit_tool="scorepad",
            end_on_text=True,
            limits=limits or EpisodeLimits(max_turns=12),
        )


def judgement_check(
    state: Mapping[str, Any], submission: Any, labels: Sequence[str], tol: float = TOTAL_TOL
) -> tuple[str, str] | None:
    """None when the judgement is valid, else ``(reason, detail)``; checks in protocol order.

    Reasons: ``no_scorepad`` (the episode ended without one), ``unread``, ``no_rubric``,
    ``unscored``, ``scorepad_candidates`` (the scorepad does not name exactly the candidates),
    ``inconsistent_total`` (|total - Σ_c w_c s_c| > tol).
    """
    if not isinstance(submission, Mapping) or not isinstance(submission.get("scores"), Mapping):
        return "no_scorepad", "the judgement ended without a scorepad call"
    unread = [lab for lab in labels if lab not in state["read"]]
    if unread:
        return "unread", f"candidates not read: {', '.join(unread)}"
    rubric = state["rubric"]
    if not rubric:
        return "no_rubric", "no rubric was written"
    missing = [f"{lab}:{c['name']}" for lab in labels for c in rubric if c["name"] not in state["scores"].get(lab, {})]
    if missing:
        return "unscored", f"not scored: {', '.join(missing)}"
    pad = submission["scores"]
    if sorted(pad) != sorted(labels):
        return "scorepad_candidates", f"scorepad names {sorted(pad)}, the candidates are {list(labels)}"
    for lab in labels:
        want = sum(c["weight"] * state["scores"][lab][c["name"]] for c in rubric)
        if not abs(float(pad[lab]) - want) <= tol:  # NaN / inf totals fail too
            return "inconsistent_total", f"scorepad total of {lab} is {pad[lab]:g}, the weighted scores sum to {want:g}"
    return None


@register_verifier(JUDGE_VERIFIER)
def verify_judgement(task: Task, final: FinalState) -> Verdict:
    """Reward 1 for a valid judgement, else 0. Components: ``valid``; when valid ``total.<label>``
    (the scorepad's totals) and ``max_total`` (SCORE_MAX · Σ weights). Diagnostics start with the
    reason (``valid`` or a `judgement_check` reason) and a colon."""
    labels = list(task.metadata["labels"])
    if final.truncated:
        return Verdict(0.0, {"valid": 0.0}, f"truncated: the judgement hit {final.truncation} without a scorepad")
    bad = judgement_check(final.state, final.submission, labels, float(task.metadata["total_tol"]))
    if bad is not None:
        return Verdict(0.0, {"valid": 0.0}, f"{bad[0]}: {bad[1]}")
    pad = final.submission["scores"]
    comps = {"valid": 1.0, **{f"total.{lab}": float(pad[lab]) for lab in labels}}
    comps["max_total"] = SCORE_MAX * sum(c["weight"] for c in final.state["rubric"])
    return Verdict(1.0, comps, "valid: " + ", ".join(f"{lab}={float(pad[lab]):g}" for lab in labels))


def judgement_reason(verdict: Verdict) -> str:
    """The reason category of a judge verdict (``valid`` or why it is invalid)."""
    return verdict.diagnostics.split(":", 1)[0]
