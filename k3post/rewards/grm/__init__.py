"""The agentic generative reward model (GRM) for non-verifiable tasks (SPEC §3.4).

The judge is a model run as an agent in `GRMJudgeEnv`, a `ToolEnvironment` whose tools read the
candidates and record a judgement. The harness enforces the protocol:

    1. ``read_candidate(id)``                      every candidate's final response / artifacts;
    2. ``write_rubric(criteria=[{name, weight}])``  criteria with positive weights (once);
    3. ``score(candidate, scores={criterion: s})``  every candidate on every criterion, s in [0, 10];
    4. ``scorepad(scores={candidate: total})``      ends the episode; the ONLY thing rewards read.

A call out of order (a rubric before every candidate was read, a score before the rubric or for an
unread candidate, a repeated rubric or score) is refused with an error observation and not recorded,
so the recorded steps are always in protocol order. The scorepad call always ends the episode; the
registered verifier ``grm.judgement`` (`judgement_check`) then decides whether the judgement is
valid: every candidate read, a rubric, every (candidate, criterion) scored, the scorepad names
exactly the candidates, and each total equals Σ_c w_c · s_c within ``total_tol`` (default 0.01).
An episode that ends otherwise (plain-text answer, turn limit, malformed model output) is invalid.
An invalid judgement is retried (a fresh episode) up to ``max_retries`` times, then counted as a
tie. Text the judge writes (content, reasoning, tool arguments other than the scorepad) never
reaches a reward.

Tournament (``tournament_rewards``): pairs of the K-group's candidates are compared (all pairs, or
``rounds`` rounds of the circle-method round robin). For a pair (i, j) with lengths ℓ_i, ℓ_j and the
length limit L = σ·ℓ0 (SPEC §3.4; σ = 1.5 default, ours), the length guard decides first, before
any judge call:

    ℓ_i > L ≥ ℓ_j  ->  s_ij = 0        (i loses automatically)
    ℓ_i, ℓ_j > L   ->  s_ij = 1/2      (tie)
    otherwise      ->  the judge: s_ij = 1 if total_i - total_j > tol, 0 if < -tol, else 1/2

A candidate's reward is its win rate r_i = (1/|P_i|) Σ_{j∈P_i} s_ij over the comparisons P_i it
took part in (1/2 when it had none, e.g. a bye in a single round with odd K). r_i ∈ [0, 1].

Order bias: with ``both_orders=False`` (default) each pair is shown once, in an order drawn from
``random.Random(seed)``; with ``both_orders=True`` it is shown in both orders (two judgements,
each retried on its own) and s_ij is the mean of the two outcomes (so s_ij ∈ {0, ¼, ½, ¾, 1}).
A judge that always prefers whichever candidate is labelled A then gives every pair ½.

ℓ0 (`estimate_l0`) is the initial verbosity of the cold-start model: the median response length of
its samples of a family (ours: the median, robust to a few runaway generations), in the same unit
as `Candidate.length`: for rollouts, the response tokens that `trajectory_candidate` counts (use it
on the cold-start trajectories too); a candidate without a length is measured in
whitespace-separated words.

Backends (`JudgeBackend`): `PolicyJudge` runs the judge episodes with `run_episode` for any
episode policy (a scripted program, `OpenAIPolicy` for an OpenAI-compatible URL); `EngineJudge`
runs them as `AgentLoop` trajectories on a steppable engine (`EmbeddedEngine` over any local
checkpoint): the same XTML rendering, parsing and tool dispatch as RL rollouts, all judgements of a
batch decoded together. `GRMJudge` adapts a backend to the synth `Judge` protocol (one candidate,
score = total / (10 Σ_c w_c)); `GroupGRM` is the RL loop's group scorer (``k3post.stages.rl.GroupScorer``):
a finished group's trajectories -> `trajectory_candidate` -> `tournament_rewards`.

Shape legend: K candidates in one group.

Layout: `protocol.py` (the judge task, `GRMJudgeEnv`, `judgement_check`, the registered verifier), `backends.py`
(`JudgeBackend`, `PolicyJudge`, `EngineJudge`, `run_judgements`), `tournament.py` (the pure math, `tournament_rewards`,
`GRMJudge`, `GroupGRM`); every public name is importable from `k3post.rewards.grm`.
"""

from k3post.rewards.grm.backends import (
    EngineJudge,
    JudgeBackend,
    JudgementOutcome,
    PolicyJudge,
    judge_transport_failure,
    run_judgements,
)
from k3post.rewards.grm.protocol import (
    JUDGE_VERIFIER,
    LABELS,
    SCORE_MAX,
    TOTAL_TOL,
    Candidate,
    GRMJudgeEnv,
    judge_task,
    judgement_check,
    judgement_reason,
    verify_judgement,
)
from k3post.rewards.grm.tournament import (
    Comparison,
    GRMJudge,
    GroupGRM,
    TournamentResult,
    TournamentStats,
    estimate_l0,
    length_guard,
    pairwise_preference,
    round_robin_pairs,
    tournament_rewards,
    trajectory_candidate,
    win_rates,
)

__all__ = [
    "SCORE_MAX",
    "TOTAL_TOL",
    "JUDGE_VERIFIER",
    "LABELS",
    "Candidate",
    "Comparison",
    "EngineJudge",
    "GRMJudge",
    "GRMJudgeEnv",
    "GroupGRM",
    "JudgeBackend",
    "JudgementOutcome",
    "PolicyJudge",
    "TournamentResult",
    "TournamentStats",
    "estimate_l0",
    "judge_task",
    "judge_transport_failure",
    "judgement_check",
    "judgement_reason",
    "length_guard",
    "pairwise_preference",
    "round_robin_pairs",
    "run_judgements",
    "tournament_rewards",
    "trajectory_candidate",
    "verify_judgement",
    "win_rates",
]
