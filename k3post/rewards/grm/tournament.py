"""The GRM tournament: the length guard, pairwise outcomes and win rates, the round robin, ℓ0; `tournament_rewards`
over a K-group; the synth `Judge` adapter (`GRMJudge`) and RL's group scorer (`GroupGRM`). See `k3post.rewards.grm`
for the whole design."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from k3post.envs.task import Task
from k3post.rewards.grm.backends import JudgeBackend, run_judgements
from k3post.rewards.grm.protocol import TOTAL_TOL, Candidate, _as_candidate, judge_task

if TYPE_CHECKING:
    from k3post.rollout.trajectory import Group, Trajectory
    from k3post.synth.verify import JudgeResult
    from k3post.xtml import XTML



# =========================================================================== pure math


def length_guard(len_i: float, len_j: float, limit: float | None) -> float | None:
    """The guard's outcome s_ij for candidate i against j, or None when the judge must decide.

    ``limit`` is L = σ·ℓ0 (None disables the guard). ℓ_i > L ≥ ℓ_j: 0.0; ℓ_j > L ≥ ℓ_i: 1.0;
    both over: 0.5; neither: None. A length equal to L is not over.
    """
    if limit is None:
        return None
    over_i, over_j = len_i > limit, len_j > limit
    if over_i and over_j:
        return 0.5
    if over_i:
        return 0.0
    if over_j:
        return 1.0
    return None


def pairwise_preference(total_a: float, total_b: float, tol: float = TOTAL_TOL) -> float:
    """Outcome for the candidate labelled A from scorepad totals: 1 if a - b > tol, 0 if b - a > tol, else 0.5.

    Totals within ``tol`` tie: the scorepad is only checked to that tolerance.
    """
    d = float(total_a) - float(total_b)
    return 1.0 if d > tol else 0.0 if d < -tol else 0.5


def win_rates(num_candidates: int, outcomes: Sequence[tuple[int, int, float]]) -> list[float]:
    """r_i = mean of s_ij over the comparisons i took part in (0.5 when none).

    ``outcomes`` holds ``(i, j, s_ij)`` with s_ij ∈ [0, 1] the outcome for i; j gets 1 - s_ij.
    Returns ``rewards_K``.
    """
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    got_K = [0.0] * num_candidates
    n_K = [0] * num_candidates
    for i, j, s in outcomes:
        if not (0 <= i < num_candidates and 0 <= j < num_candidates) or i == j:
            raise ValueError(f"comparison ({i}, {j}) is not a pair of distinct candidates 0..{num_candidates - 1}")
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"outcome of ({i}, {j}) must be in [0, 1], got {s!r}")
        got_K[i] += s
        got_K[j] += 1.0 - s
        n_K[i] += 1
        n_K[j] += 1
    return [g / n if n else 0.5 for g, n in zip(got_K, n_K)]


def round_robin_pairs(num_candidates: int, rounds: int | None = None, seed: int = 0) -> list[tuple[int, int]]:
    """Pairs of the circle-method round robin, ``i < j`` in each pair.

    K candidates (plus one bye when K is odd: K' = K + 1) sit in an order shuffled by
    ``random.Random(seed)``; round r pairs seat k with seat K'-1-k, then seats 1..K'-1 rotate by
    one. Every candidate plays at most once per round, and K'-1 rounds play every pair exactly
    once. ``rounds=None`` plays all K'-1 rounds (all K(K-1)/2 pairs).
    """
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    seats: list[int | None] = list(range(num_candidates))
    random.Random(seed).shuffle(seats)
    if len(seats) % 2:
        seats.append(None)
    n_rounds = len(seats) - 1
    if rounds is not None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= n_rounds:
            raise ValueError(f"rounds must be an int in 1..{n_rounds} for {num_candidates} candidates, got {rounds!r}")
        n_rounds = rounds
    pairs = []
    for _ in range(n_rounds):
        for k in range(len(seats) // 2):
            a, b = seats[k], seats[len(seats) - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        seats = seats[:1] + seats[-1:] + seats[1:-1]
    return pairs


def estimate_l0(lengths: Sequence[float]) -> float:
    """ℓ0: the median of the cold-start model's response lengths for one family (see the module doc)."""
    vals = [float(x) for x in lengths]
    if not vals:
        raise ValueError("estimate_l0 needs at least one length")
    if any(not v >= 0 for v in vals):
        raise ValueError(f"lengths must be >= 0, got {[v for v in vals if not v >= 0][:3]}")
    return float(statistics.median(vals))



@dataclass
class Comparison:
    """One pair of the tournament.

    Attributes:
        i, j: candidate indices.
        score_i: s_ij, the outcome for i (j gets 1 - score_i).
        decided_by: ``judge``, ``guard`` (exactly one over σ·ℓ0) or ``guard_tie`` (both over).
        presentations: per judgement, ``[first, second]`` candidate indices as shown (labels A, B).
        outcomes: per presentation, the outcome for i (0.5 for a forfeit).
        verdicts: per presentation, the valid verdict (`Verdict.to_dict`) or None (forfeit).
    """

    i: int
    j: int
    score_i: float
    decided_by: str
    presentations: list[list[int]] = field(default_factory=list)
    outcomes: list[float] = field(default_factory=list)
    verdicts: list[dict[str, Any] | None] = field(default_factory=list)


@dataclass
class TournamentStats:
    """Counters of one tournament.

    Attributes:
        comparisons: pairs compared (guarded ones included).
        judgements: judge episodes run (retries included).
        invalid: judge episodes whose judgement was invalid.
        retried: re-runs after an invalid judgement.
        forfeits: presentations counted as a tie after 1 + max_retries invalid judgements.
        ties: comparisons with s_ij = 0.5 (a judged tie, forfeits, both over the guard).
        guard_losses: comparisons decided by the guard (exactly one candidate over σ·ℓ0).
        guard_ties: comparisons where both were over.
        invalid_reasons: reason -> count over invalid judgements.
    """

    comparisons: int = 0
    judgements: int = 0
    invalid: int = 0
    retried: int = 0
    forfeits: int = 0
    ties: int = 0
    guard_losses: int = 0
    guard_ties: int = 0
    invalid_reasons: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = asdict(self)
        d["invalid_reasons"] = dict(self.invalid_reasons)
        return d

    def add(self, other: "TournamentStats") -> "TournamentStats":
        """Add ``other``'s counters into these (returns self)."""
        for f in fields(self):
            if f.name != "invalid_reasons":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.invalid_reasons.update(other.invalid_reasons)
        return self


@dataclass
class TournamentResult:
    """``rewards_K`` (win rates in [0, 1]), the comparisons and the counters."""

    rewards_K: list[float]
    comparisons: list[Comparison]
    stats: TournamentStats


def tournament_rewards(
    candidates: Sequence[Candidate | str],
    judge: JudgeBackend,
    *,
    prompt: str,
    sigma: float = 1.5,
    l0: float | None = None,
    rounds: int | None = None,
    both_orders: bool = False,
    max_retries: int = 1,
    seed: int = 0,
    domain: str = "general",
    total_tol: float = TOTAL_TOL,
) -> TournamentResult:
    """Win-rate rewards of a K-group of candidates answering ``prompt`` (see the module doc).

    Args:
        candidates: the K candidates (strings or `Candidate`).
        judge: the judge backend.
        prompt: the request the candidates answered (shown to the judge).
        sigma / l0: the length guard limit σ·ℓ0; ``l0=None`` disables the guard.
        rounds: None: all pairs; else that many circle-method rounds (`round_robin_pairs`).
        both_orders: show each judged pair in both orders (else one order drawn with ``seed``).
        max_retries: re-runs of an invalid judgement before it counts as a tie.
        seed: seeds the seating of the round robin and the presentation order.
        domain / total_tol: of the judge tasks (`judge_task`).
    """
    cands = [_as_candidate(c) for c in candidates]
    if not cands:
        raise ValueError("tournament_rewards needs at least one candidate")
    if l0 is not None and (isinstance(l0, bool) or not l0 > 0):
        raise ValueError(f"l0 must be a positive number or None, got {l0!r}")
    if isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")
    if not isinstance(judge, JudgeBackend):
        raise ValueError(f"judge must be a JudgeBackend (with run(tasks)), got {type(judge).__name__}")
    limit = None if l0 is None else sigma * l0
    rng = random.Random(seed)
    stats = TournamentStats()
    comps: list[Comparison] = []
    tasks: list[Task] = []
    slots: list[tuple[Comparison, int]] = []  # (comparison, index of its first candidate in the task)
    for i, j in round_robin_pairs(len(cands), rounds, seed):
        stats.comparisons += 1
        guard = length_guard(cands[i].size, cands[j].size, limit)
        if guard is not None:
            comps.append(Comparison(i, j, guard, "guard_tie" if guard == 0.5 else "guard"))
            continue
        comp = Comparison(i, j, 0.5, "judge")
        comps.append(comp)
        orders = [[i, j], [j, i]] if both_orders else [[i, j] if rng.random() < 0.5 else [j, i]]
        for first, second in orders:
            comp.presentations.append([first, second])
            tasks.append(judge_task(prompt, [cands[first], cands[second]], task_id=f"grm-{i}-{j}-{first}",
                                    domain=domain, total_tol=total_tol))
            slots.append((comp, first))
    for (comp, first), res in zip(slots, run_judgements(judge, tasks, max_retries)):
        stats.judgements += res.attempts
        stats.invalid += len(res.invalid_reasons)
        stats.retried += res.attempts - 1
        stats.invalid_reasons.update(res.invalid_reasons)
        if res.verdict is None:
            stats.forfeits += 1
            s_first = 0.5
        else:
            c = res.verdict.components
            s_first = pairwise_preference(c["total.A"], c["total.B"], total_tol)
        comp.outcomes.append(s_first if first == comp.i else 1.0 - s_first)
        comp.verdicts.append(None if res.verdict is None else res.verdict.to_dict())
    for comp in comps:
        if comp.decided_by == "judge":
            comp.score_i = sum(comp.outcomes) / len(comp.outcomes)
        stats.ties += comp.score_i == 0.5
        stats.guard_losses += comp.decided_by == "guard"
        stats.guard_ties += comp.decided_by == "guard_tie"
    rewards_K = win_rates(len(cands), [(c.i, c.j, c.score_i) for c in comps])
    return TournamentResult(rewards_K, comps, stats)


# =========================================================================== synth Judge adapter


class GRMJudge:
    """The synth `Judge` protocol over a GRM backend: one candidate, scored against the rubric.

    The sample's final assistant response is the only candidate of a judge task whose request is
    the sample's system / user prompt; score = total / max_total = Σ_c w_c s_c / (SCORE_MAX Σ_c w_c)
    ∈ [0, 1]. A judgement still invalid after ``max_retries`` retries is ``uncertain`` (score 0):
    a human decides.
    """

    def __init__(self, backend: JudgeBackend, *, max_retries: int = 1, total_tol: float = TOTAL_TOL) -> None:
        if not isinstance(backend, JudgeBackend):
            raise ValueError(f"backend must be a JudgeBackend (with run(tasks)), got {type(backend).__name__}")
        self.backend = backend
        self.max_retries = max_retries
        self.total_tol = total_tol

    def judge(self, sample: Mapping[str, Any]) -> "JudgeResult":
        """Score ``sample`` (a synthesized record with ``task`` and ``messages``)."""
        from k3post.envs.families.common import prompt_text
        from k3post.synth.verify import JudgeResult, _final_response

        task = Task.from_dict(sample["task"])
        jt = judge_task(prompt_text(task), [_final_response(sample.get("messages") or [])], task_id=f"grm-{task.id}",
                        domain=task.domain, total_tol=self.total_tol)
        (res,) = run_judgements(self.backend, [jt], self.max_retries)
        if res.verdict is None:
            return JudgeResult(0.0, True, f"GRM judgement invalid in {res.attempts} attempts: {', '.join(res.invalid_reasons)}")
        c = res.verdict.components
        score = c["total.A"] / c["max_total"]
        return JudgeResult(min(1.0, max(0.0, score)), False, f"GRM total {c['total.A']:g} of {c['max_total']:g}")


# =========================================================================== RL group scorer


def trajectory_candidate(traj: "Trajectory", xtml: "XTML", mode: str = "think") -> Candidate:
    """The candidate of a finished trajectory: its last assistant turn's response, and its length.

    The last turn is the last run of sampled tokens; it is parsed with `XTML.parse` (a turn that does
    not parse gives an empty response). ``length`` is that turn's sampled tokens after its think
    channel (after the first ``<|close|>`` in think mode; the whole turn in instruct mode), i.e. the
    response's tokens as generated, ``<|end_of_msg|>`` included. Measure ℓ0 with this function on the
    cold-start model's trajectories so both are in the same unit.
    """
    from k3post.xtml import XTMLParseError

    end = len(traj.trainable)
    while end > 0 and not traj.trainable[end - 1]:
        end -= 1
    start = end
    while start > 0 and traj.trainable[start - 1]:
        start -= 1
    turn = traj.token_ids[start:end]
    try:
        text = xtml.parse(turn, mode=mode, partial=not turn or turn[-1] != xtml.eom_id, after_prefix=True)["content"]
    except XTMLParseError:
        text = ""
    response = turn[turn.index(xtml.close_id) + 1 :] if mode == "think" and xtml.close_id in turn else turn
    return Candidate(text, length=len(response))


class GroupGRM:
    """The RL loop's ``GroupScorer`` for non-verifiable families: a finished `Group` -> win rates.

    Each trajectory becomes a `trajectory_candidate`; the request shown to the judge is the task's
    system / user prompt; ℓ0 comes from ``l0[family]`` (no entry: no length guard). Every call's
    `TournamentResult` is kept in ``last`` and its counters are summed in ``stats``.
    """

    def __init__(
        self,
        judge: JudgeBackend,
        xtml: "XTML",
        *,
        l0: Mapping[str, float] | None = None,
        sigma: float = 1.5,
        mode: str = "think",
        rounds: int | None = None,
        both_orders: bool = False,
        max_retries: int = 1,
        seed: int = 0,
    ) -> None:
        if not isinstance(judge, JudgeBackend):
            raise ValueError(f"judge must be a JudgeBackend (with run(tasks)), got {type(judge).__name__}")
        self.judge = judge
        self.xtml = xtml
        self.l0 = dict(l0 or {})
        self.sigma = sigma
        self.mode = mode
        self.kw: dict[str, Any] = {"rounds": rounds, "both_orders": both_orders, "max_retries": max_retries}
        self.seed = seed
        self.last: TournamentResult | None = None
        self.stats = TournamentStats()
        self.gate: dict[str, Any] | None = None  # RL's judge gate result when one was measured (`k3post.rewards.judge.apply_judge_gate`)

    def __call__(self, group: "Group") -> list[float]:
        """``rewards_K`` of the group's trajectories (seeded by ``seed`` and the group id)."""
        from k3post.envs.families.common import prompt_text

        task = Task.from_dict(group.task)
        cands = [trajectory_candidate(t, self.xtml, self.mode) for t in group.trajectories]
        res = tournament_rewards(cands, self.judge, prompt=prompt_text(task), sigma=self.sigma, l0=self.l0.get(task.family),
                                 seed=self.seed + group.group_id, domain=task.domain, **self.kw)
        self.last = res
        self.stats.add(res.stats)
        return res.rewards_K

    def close(self) -> None:
        """Release the judge backend (its engine or HTTP client), when it holds any."""
        close = getattr(self.judge, "close", None)
        if callable(close):
            close()
