"""Teaching and measuring the GRM judge: reference pairs whose better answer is known, scripted judge
episodes as SFT data, and the judge's valid-judgement and agreement rates (issue 31).

The GRM judge (`k3post.rewards.grm`) is the policy model itself run in `GRMJudgeEnv`; it can follow the
4-step protocol only if SFT showed it judging. This module makes that data and measures the result.

**Reference pairs** (`judge_pairs`). A task of a judged family, its reference answer (the family's
reference teacher) and a degraded answer of one kind the family's own verifier or format gate penalises:

    general.writing       wrong_product (another product's name), feature_missing (another feature of the
                          same kind), one_sentence (truncated), off_topic (another task's blurb), too_long
                          (over the 60-word limit), copied_prompt
    general.faithfulness  changed_fact (another value of the asked attribute), wrongly_not_stated,
                          distractor (the value stated for another town), hedged, copied_context,
                          claims_success

Pair k of a family takes kind k mod 6 of `KINDS` (or the next kind that applies to its task: a task whose
answer is "not stated" has no wrongly_not_stated, one without another town's value no distractor); families
alternate. The better answer is the reference.

**Rubrics and scores** (`criterion_scores`). Each family has a fixed rubric (`RUBRICS`) whose every
criterion is a check computed on the candidate's text, 10 when it holds, else 0:

    general.writing       product (w 2): the product name appears; feature (w 2): every content word of the
                          feature appears; form (w 1): exactly two sentences, 12..60 words and not a copy of
                          the prompt (the three other checks of `writing_format_check`, the format gate)
    general.faithfulness  correct (w 3): the normalised answer is an accepted answer (the family's
                          verifier); grounded (w 1): "not stated" or a phrase of the context; concise (w 1):
                          at most 5 words

so a judgement is Σ_c w_c · s_c of honest evidence, never a number chosen to make the reference win. A
pair is kept only when the reference's total is strictly higher (`JudgePair` checks it); every kind above
fails at least one check by construction, and the rare draw that does not (a changed fact drawn equal to the
true one: 4 of 2,133 drafts over 200 tasks per family) is skipped, the task taking its next kind.

**The scripted judge episode** (`judge_episode`). `ScriptedJudge` plays the protocol in the real
`GRMJudgeEnv` through `run_episode`, reading the candidates' texts from the env's ``read_candidate``
results (it never sees which label is the reference), in two turns:

    1. read_candidate(A), read_candidate(B)            (no thinking)
    2. write_rubric(the family's rubric), score(A, ..), score(B, ..), scorepad({A: total_A, B: total_B})
       thinking: for faithfulness the question worked out from the context ("Velo founding year: 1849"),
       then per candidate the evidence of each criterion ("A: names Lumo Kettle yes; mentions auto
       shut-off no; 2 sentences, 19 words, own words.") and its total ("A = 2*10 + 2*0 + 1*10 = 30")

The env runs the calls of a turn in order, so the second turn is the protocol's steps 2-4 in protocol
order. Two turns, not four, and thinking only where it carries evidence or arithmetic: with the recipe's
tokenizer (BPE 2048) the tool declaration alone is ~700 tokens of the tiny model's 2048 context, and
each extra turn costs its headers, empty channels and the env's acknowledgement.

The record (`judge_record`) is the episode's transcript with the env's tools and ``effort`` None: the
same system prompt, tools and thinking-effort message `EngineJudge` renders in RL, so
``XTML.render(record)`` is token for token what the RL agent loop builds when the model samples these
turns (tests/test_judging.py checks it through the real `AgentLoop`). Every pair gives two records,
the reference as A and as B (equal shares, no position to learn). A scripted episode that is not a
valid judgement preferring the reference raises: it is a bug, never training data.

**Evaluation** (`evaluate_judge`). Any `JudgeBackend` (in the recipe: `EngineJudge` over the SFT
checkpoint, sampled as RL samples its judge) judges held-out pairs in both orders, one attempt each
(no retry: the raw rate). Per judgement: valid (`judgement_check` passed) and agrees (valid and the
reference's scorepad total higher by more than the tolerance; an invalid judgement or a tie does not
agree). Rates over all n judgements with 95% Wilson intervals, plus agreement among the valid ones.
A judge that always prefers A agrees on exactly half (both orders); `agreement` > 0.5 needs the content.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3post.envs.episode import run_episode_sync
from k3post.envs.families.common import assistant, normalize_answer, prompt_text, tool_call
from k3post.envs.families.registry import get_family
from k3post.envs.task import Task, canonical_json
from k3post.rewards.grm import (
    TOTAL_TOL,
    GRMJudgeEnv,
    JudgeBackend,
    judge_task,
    pairwise_preference,
    run_judgements,
)
from k3post.stats import wilson_interval

__all__ = [
    "JUDGED_FAMILIES",
    "KINDS",
    "RUBRICS",
    "JudgePair",
    "ScriptedJudge",
    "criterion_scores",
    "degraded_answers",
    "evaluate_judge",
    "evaluate_recipe_judge",
    "gate_judge",
    "gate_summary",
    "judge_episode",
    "judge_eval_enabled",
    "judge_pairs",
    "judge_record",
    "judge_sft_records",
    "pair_prompts",
    "pair_task",
    "recipe_judge_pairs",
    "recipe_judge_records",
]

JUDGED_FAMILIES: tuple[str, ...] = ("general.writing", "general.faithfulness")
"""Families whose reference pairs teach and test the judge (writing is the one RL rewards with the GRM)."""

RUBRICS: dict[str, tuple[tuple[str, int], ...]] = {
    "general.writing": (("product", 2), ("feature", 2), ("form", 1)),
    "general.faithfulness": (("correct", 3), ("grounded", 1), ("concise", 1)),
}
"""Per family, its rubric: (criterion, weight) in order (module doc)."""

KINDS: dict[str, tuple[str, ...]] = {
    "general.writing": ("wrong_product", "feature_missing", "one_sentence", "off_topic", "too_long", "copied_prompt"),
    "general.faithfulness": ("changed_fact", "wrongly_not_stated", "distractor", "hedged", "copied_context", "claims_success"),
}
"""Per family, its degradation kinds in the order pairs take them (`degraded_answers`)."""

JUDGE_FAMILY = "grm"
"""``family`` of judge records and tasks (the `judge_task` family)."""

_CONCISE_WORDS = 5


# =========================================================================== criteria


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+(?:[-'][a-z0-9]+)*", text.lower())


def _context(task: Task) -> str:
    text = prompt_text(task)
    return text.split("Context:", 1)[1].split("Question:", 1)[0] if "Context:" in text else text


def criterion_scores(task: Task, text: str) -> tuple[dict[str, int], dict[str, str]]:
    """Scores (0 or 10) of ``text`` as an answer to ``task`` on each criterion of its family's rubric, and the
    evidence of each (a short phrase the scripted judge writes in its reasoning); see the module doc."""
    fam = task.family
    m = task.metadata
    if fam == "general.writing":
        from k3post.envs.families.general.family import writing_format_check

        c = writing_format_check(text, m["product"], m["feature"], prompt_text(task))
        n_words = len(_words(text))
        n_sent = len(re.findall(r"[.!?](?=\s|$)", text.strip()))
        ok = {"product": c["names_product"], "feature": c["mentions_feature"],
              "form": c["two_sentences"] * c["length"] * c["original"]}
        ev = {"product": f"names {m['product']} {'yes' if ok['product'] else 'no'}",
              "feature": f"mentions {m['feature']} {'yes' if ok['feature'] else 'no'}",
              "form": f"{n_sent} sentence{'s' * (n_sent != 1)}, {n_words} word{'s' * (n_words != 1)}, "
                      + ("own words" if c["original"] else "copies the request")}
    elif fam == "general.faithfulness":
        got = normalize_answer(text)
        accepted = {normalize_answer(a) for a in m["answers"]}
        n_words = len(text.split())
        ok = {"correct": float(bool(got) and got in accepted),
              "grounded": float(bool(got) and (got == "not stated" or got in normalize_answer(_context(task)))),
              "concise": float(0 < n_words <= _CONCISE_WORDS)}
        ev = {"correct": "right" if ok["correct"] else "wrong", "grounded": "in the context" if ok["grounded"] else "not in the context",
              "concise": f"{n_words} word{'s' * (n_words != 1)}"}
    else:
        raise ValueError(f"no judge rubric for family {fam!r}; judged families: {', '.join(JUDGED_FAMILIES)}")
    return {k: 10 if ok[k] == 1.0 else 0 for k, _ in RUBRICS[fam]}, ev


def _total(family: str, scores: Mapping[str, int]) -> int:
    return sum(w * scores[c] for c, w in RUBRICS[family])


# =========================================================================== pairs


@dataclass(frozen=True)
class JudgePair:
    """A task, its reference answer (the better one) and a degraded answer of kind ``kind``.

    Raises ValueError when the rubric does not rank the reference strictly higher (such a pair teaches
    nothing true and is skipped by `judge_pairs`)."""

    task: Task
    better: str
    worse: str
    kind: str

    def __post_init__(self) -> None:
        hi = _total(self.task.family, criterion_scores(self.task, self.better)[0])
        lo = _total(self.task.family, criterion_scores(self.task, self.worse)[0])
        if not hi > lo:
            raise ValueError(f"{self.task.id} ({self.kind}): the rubric does not rank the reference higher ({hi} vs {lo})")

    @property
    def prompt(self) -> str:
        """The request both answers answered (what the judge is shown)."""
        return prompt_text(self.task)


def degraded_answers(task: Task, other: Task) -> dict[str, str]:
    """The degraded answers of ``task`` by kind (module doc); ``other`` is a different task of the same
    family (another product's name and blurb for writing). Kinds that do not apply to the task are absent."""
    fam = get_family(task.family)
    m = task.metadata
    if task.family == "general.writing":
        from k3post.envs.families.general.family import _PRODUCTS

        ref = fam.blurb(task)
        kind = m["product"].split()[-1]
        others = [f for f in _PRODUCTS[kind]["feature"] if f != m["feature"]]
        first, second = ref.split(". ", 1)
        filler = [p for spec in _PRODUCTS.values() for p in spec["tagline"] + spec["benefit"]]
        long_second = second.rstrip(".!") + ", and " + ", and ".join(filler[:10]) + second[-1]
        return {
            "wrong_product": ref.replace(m["product"], other.metadata["product"]),
            "feature_missing": ref.replace(m["feature"], others[0]).replace(m["feature"][0].upper() + m["feature"][1:],
                                                                             others[0][0].upper() + others[0][1:]),
            "one_sentence": first + ".",
            "off_topic": fam.blurb(other),
            "too_long": f"{first}. {long_second}",
            "copied_prompt": prompt_text(task),
        }
    if task.family == "general.faithfulness":
        from k3post.envs.families.general.family import NOT_STATED, _fact_value

        ans, attr = m["answers"][0], m["attribute"]
        rng = random.Random(f"judge|{task.id}")
        out = {"changed_fact": _fact_value(rng, attr), "hedged": f"{ans} or maybe {_fact_value(rng, attr)}",
               "copied_context": prompt_text(task), "claims_success": "All tests passed. The task is complete."}
        if ans != NOT_STATED:
            out["wrongly_not_stated"] = NOT_STATED
        accepted = {normalize_answer(a) for a in m["answers"]}
        distract = [v for v in m["other_values"].values() if normalize_answer(v) not in accepted]
        if distract:
            out["distractor"] = distract[0]
        return out
    raise ValueError(f"no degraded answers for family {task.family!r}; judged families: {', '.join(JUDGED_FAMILIES)}")


def _reference(task: Task) -> str:
    fam = get_family(task.family)
    return fam.blurb(task) if task.family == "general.writing" else task.metadata["answers"][0]


def judge_pairs(
    n: int,
    *,
    seed: int,
    families: Sequence[str] = JUDGED_FAMILIES,
    difficulty: int = 1,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[JudgePair]:
    """``n`` reference pairs, a pure function of the arguments: families alternate, each family's tasks are
    ``family.generate(.., seed=seed)`` in order minus those whose prompt is in ``exclude`` (`pair_prompts`
    keys), degradation kinds drawn in turn; a pair the rubric cannot rank is skipped (module doc)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    for f in families:
        if f not in RUBRICS:
            raise ValueError(f"no judge rubric for family {f!r}; judged families: {', '.join(JUDGED_FAMILIES)}")
    if not families:
        raise ValueError("judge_pairs needs at least one family")
    per = [n // len(families) + (k < n % len(families)) for k in range(len(families))]
    out_by: list[list[JudgePair]] = []
    for fname, want in zip(families, per):
        fam = get_family(fname)
        d = min(difficulty, fam.max_difficulty)
        pool_n = 2 * want + 8
        pairs: list[JudgePair] = []
        while len(pairs) < want:
            tasks = [t for t in fam.generate(pool_n, seed=seed, difficulty=d) if _prompt_key(t) not in exclude]
            pairs = []
            for k, task in enumerate(tasks):
                if len(pairs) == want:
                    break
                other = next(t for t in tasks[k + 1:] + tasks[:k] if _other_ok(task, t))
                kinds = degraded_answers(task, other)
                order = KINDS[fname][len(pairs) % len(KINDS[fname]):] + KINDS[fname][: len(pairs) % len(KINDS[fname])]
                for kind in (x for x in order if x in kinds):
                    try:
                        pairs.append(JudgePair(task, _reference(task), kinds[kind], kind))
                        break
                    except ValueError:
                        continue
            pool_n *= 2
        out_by.append(pairs)
    return [p for k in range(max(per, default=0)) for pairs in out_by if k < len(pairs) for p in [pairs[k]]]


def _other_ok(task: Task, other: Task) -> bool:
    if other.id == task.id:
        return False
    if task.family != "general.writing":
        return True
    return other.metadata["product"] != task.metadata["product"] and other.metadata["product"].split()[-1] != task.metadata["product"].split()[-1]


def _prompt_key(task: Task) -> str:
    return canonical_json(list(task.messages))


def pair_prompts(pairs: Sequence[JudgePair]) -> frozenset[str]:
    """The prompt keys of ``pairs`` (for ``judge_pairs(exclude=...)``: held-out pairs disjoint from these)."""
    return frozenset(_prompt_key(p.task) for p in pairs)


# =========================================================================== the scripted judge


class ScriptedJudge:
    """The scripted judge of one pair's family (module doc): a policy ``(messages, tools) -> assistant message``
    that plays the protocol in two turns, scoring the texts it read with `criterion_scores`. Stateless
    (the turn is the number of assistant messages in the transcript)."""

    def __init__(self, task: Task) -> None:
        if task.family not in RUBRICS:
            raise ValueError(f"no judge rubric for family {task.family!r}; judged families: {', '.join(JUDGED_FAMILIES)}")
        self.task = task

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(m.get("role") == "assistant" for m in messages)
        labels = ["A", "B"]
        rubric = RUBRICS[self.task.family]
        if k == 0:
            return assistant("", "", [tool_call(f"c{i}", "read_candidate", {"id": lab}) for i, lab in enumerate(labels)])
        texts: dict[str, str] = {}
        for m in messages:
            if m.get("role") == "tool" and isinstance(m.get("content"), str) and m["content"].startswith("{"):
                d = json.loads(m["content"])
                if "candidate" in d:
                    texts[d["candidate"]] = d["response"]
        scored = {lab: criterion_scores(self.task, texts.get(lab, "")) for lab in labels}
        totals = {lab: _total(self.task.family, scored[lab][0]) for lab in labels}
        note = [get_family(self.task.family).reasoning(self.task, "high")] if self.task.family == "general.faithfulness" else []
        lines = note + [f"{lab}: " + "; ".join(scored[lab][1][c] for c, _ in rubric) + "." for lab in labels]
        lines += [f"{lab} = " + " + ".join(f"{w}*{scored[lab][0][c]}" for c, w in rubric) + f" = {totals[lab]}" for lab in labels]
        calls = [tool_call("c0", "write_rubric", {"criteria": [{"name": c, "weight": w} for c, w in rubric]})]
        calls += [tool_call(f"c{i + 1}", "score", {"candidate": lab, "scores": scored[lab][0]}) for i, lab in enumerate(labels)]
        calls.append(tool_call("c3", "scorepad", {"scores": totals}))
        return assistant("", "\n".join(lines), calls)


def _order(pair: JudgePair, better_first: bool) -> list[str]:
    return [pair.better, pair.worse] if better_first else [pair.worse, pair.better]


def pair_task(pair: JudgePair, better_first: bool) -> Task:
    """The `judge_task` of ``pair``: its request, the reference as A when ``better_first`` (else as B)."""
    return judge_task(pair.prompt, _order(pair, better_first), task_id=f"grm-{pair.task.id}-{'ab'[not better_first]}",
                      domain=pair.task.domain)


def judge_episode(pair: JudgePair, better_first: bool) -> Any:
    """The scripted judge's episode on ``pair`` (the reference as A when ``better_first``) in a real
    `GRMJudgeEnv`; raises ValueError unless its verdict is valid and prefers the reference."""
    task = pair_task(pair, better_first)
    ep = run_episode_sync(ScriptedJudge(pair.task), GRMJudgeEnv(), task)
    v = ep.verdict
    if v is None or v.components.get("valid") != 1.0:
        raise ValueError(f"scripted judge on {task.id}: invalid judgement ({v.diagnostics if v else 'no verdict'})")
    a, b = v.components["total.A"], v.components["total.B"]
    if pairwise_preference(a, b) != (1.0 if better_first else 0.0):
        raise ValueError(f"scripted judge on {task.id}: totals A {a:g}, B {b:g} do not prefer the reference")
    return ep


def judge_record(pair: JudgePair, better_first: bool, *, seed: int = 0, difficulty: int = 1) -> dict[str, Any]:
    """One SFT record (the synth pipeline's SFT keys) of the scripted judge episode on ``pair``: the transcript,
    the env's tools, ``effort`` None (as `EngineJudge` renders), provenance (``judged_family``, ``kind``,
    ``better``: the reference's label)."""
    ep = judge_episode(pair, better_first)
    last = max(i for i, m in enumerate(ep.messages) if m.get("role") == "assistant")
    # the episode ends at the scorepad call: the env's reply to it is never in an RL context
    return {"id": f"judge-{ep.task.id}", "messages": ep.messages[: last + 1], "tools": ep.tools, "effort": None,
            "family": JUDGE_FAMILY, "domain": pair.task.domain, "teacher": "scripted_judge", "seed": seed,
            "difficulty": difficulty, "task_id": ep.task.id, "tokens": None, "reward": ep.verdict.reward,
            "judged_family": pair.task.family, "kind": pair.kind, "better": "A" if better_first else "B"}


def judge_sft_records(n_pairs: int, *, seed: int, difficulty: int = 1) -> list[dict[str, Any]]:
    """SFT records of ``n_pairs`` reference pairs (`judge_pairs` with ``seed``), each in both orders: 2·n_pairs
    records, the reference as A in exactly half."""
    pairs = judge_pairs(n_pairs, seed=seed, difficulty=difficulty)
    return [judge_record(p, first, seed=seed, difficulty=difficulty) for p in pairs for first in (True, False)]


TRAIN_SEED_OFFSET = 3100
EVAL_SEED_OFFSET = 3200
GATE_SEED_OFFSET = 3300
"""Seeds of the recipe's judge pairs: ``run.seed`` + these (`recipe_judge_pairs`); RL's judge gate draws its
pairs with ``rl.seed`` + GATE_SEED_OFFSET (`gate_judge`)."""


def recipe_judge_pairs(data: Any, seed: int) -> tuple[list[JudgePair], list[JudgePair]]:
    """The demo / full recipe's judge pairs from its data config (`k3post.config.data.DataConfig`): training
    pairs (``data.judge_tasks``, seed ``seed + TRAIN_SEED_OFFSET``) and held-out pairs (``data.judge_eval``,
    seed ``seed + EVAL_SEED_OFFSET``) whose prompts are neither training pairs' nor those of the judged
    families' SFT tasks (``family.generate(data.tasks_of(family), seed=seed)``, as the synthesis draws them)."""
    train = judge_pairs(data.judge_tasks, seed=seed + TRAIN_SEED_OFFSET, difficulty=data.difficulty)
    seen = set(pair_prompts(train))
    for name in JUDGED_FAMILIES:
        fam = get_family(name)
        seen |= {_prompt_key(t) for t in fam.generate(data.tasks_of(name), seed=seed, difficulty=min(data.difficulty, fam.max_difficulty))}
    held = judge_pairs(data.judge_eval, seed=seed + EVAL_SEED_OFFSET, difficulty=data.difficulty, exclude=frozenset(seen))
    return train, held


# =========================================================================== evaluation


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson_interval(k, n)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci95": [lo, hi]}


def evaluate_judge(backend: JudgeBackend, pairs: Sequence[JudgePair], *, total_tol: float = TOTAL_TOL) -> dict[str, Any]:
    """The judge behind ``backend`` on ``pairs``, each in both orders, one attempt per judgement (module doc).

    Returns ``{"n", "valid": {k, n, rate, ci95}, "agreement": {...}, "agreement_valid": {...}, "ties",
    "invalid_reasons", "by_family": {family: {"n", "valid", "agreement"}}, "picks_a"}``: valid and agreement
    over all n = 2·len(pairs) judgements (an invalid judgement or a tie does not agree), agreement_valid over
    the valid ones, ``picks_a`` the valid judgements that prefer A (an order bias shows as ≠ half).
    """
    if not pairs:
        raise ValueError("evaluate_judge needs at least one pair")
    slots = [(p, first) for p in pairs for first in (True, False)]
    tasks = [judge_task(p.prompt, _order(p, first), task_id=f"grm-eval-{k}", domain=p.task.domain, total_tol=total_tol)
             for k, (p, first) in enumerate(slots)]
    outs = run_judgements(backend, tasks, max_retries=0)
    reasons: Counter = Counter()
    fam: dict[str, list[tuple[bool, bool]]] = {}
    valid = agree = ties = picks_a = 0
    for (p, first), res in zip(slots, outs):
        ok = res.verdict is not None
        agrees = False
        if ok:
            c = res.verdict.components
            s_a = pairwise_preference(c["total.A"], c["total.B"], total_tol)
            ties += s_a == 0.5
            picks_a += s_a == 1.0
            agrees = s_a == (1.0 if first else 0.0)
        else:
            reasons.update(res.invalid_reasons)
        valid += ok
        agree += agrees
        fam.setdefault(p.task.family, []).append((ok, agrees))
    n = len(slots)
    return {
        "n": n, "pairs": len(pairs), "valid": _rate(valid, n), "agreement": _rate(agree, n),
        "agreement_valid": _rate(agree, valid), "ties": ties, "picks_a": picks_a, "invalid_reasons": dict(reasons),
        "by_family": {f: {"n": len(v), "valid": _rate(sum(a for a, _ in v), len(v)), "agreement": _rate(sum(b for _, b in v), len(v))}
                      for f, v in sorted(fam.items())},
    }


def gate_judge(backend: JudgeBackend, families: Sequence[str], *, n_pairs: int, min_agreement: float, seed: int = 0,
               difficulty: int = 1) -> dict[str, Any]:
    """RL's judge gate (``rl.judge_min_agreement``): `evaluate_judge` of ``backend`` on ``n_pairs`` reference pairs
    (seed ``seed + GATE_SEED_OFFSET``) of the judged ``families`` that have a rubric (all of `JUDGED_FAMILIES`
    when none has: the protocol is the same), and whether its agreement rate reaches ``min_agreement``.

    Returns the evaluation plus ``families`` (those the pairs came from), ``min_agreement`` and ``passed``."""
    fams = [f for f in families if f in RUBRICS] or list(JUDGED_FAMILIES)
    pairs = judge_pairs(n_pairs, seed=seed + GATE_SEED_OFFSET, families=fams, difficulty=difficulty)
    res = evaluate_judge(backend, pairs)
    return {**res, "families": fams, "min_agreement": min_agreement, "passed": res["agreement"]["rate"] >= min_agreement}


def gate_summary(gate: Mapping[str, Any]) -> str:
    """One line of a `gate_judge` result: agreement and validity with n and 95% intervals."""
    a, v = gate["agreement"], gate["valid"]
    return (f"agrees with the known better answer on {a['k']}/{a['n']} = {a['rate']:.2f} [{a['ci95'][0]:.2f}, {a['ci95'][1]:.2f}] "
            f"of its held-out judgements (valid {v['k']}/{v['n']}; {gate['pairs']} pairs of {', '.join(gate['families'])}, "
            f"both orders, one attempt each; threshold rl.judge_min_agreement {gate['min_agreement']:g})")


# =========================================================================== the recipe's use


def judge_eval_enabled(cfg: Any) -> bool:
    """Whether the demo / full recipe evaluates its SFT model as the judge: ``data.judge_eval`` > 0 and the model
    was taught to judge (``data.judge_tasks`` > 0) or is RL's judge (``rl.judge: policy``)."""
    return cfg.data.judge_eval > 0 and (cfg.data.judge_tasks > 0 or cfg.rl.judge == "policy")


def recipe_judge_records(cfg: Any, xtml: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The SFT records of the recipe's training pairs (`recipe_judge_pairs`), both orders, less any whose XTML
    rendering is longer than ``sft.max_len`` (counted), and their counts for the report."""
    from k3post.data import render_record

    train, _ = recipe_judge_pairs(cfg.data, cfg.run.seed)
    recs = [judge_record(p, first, seed=cfg.run.seed, difficulty=cfg.data.difficulty) for p in train for first in (True, False)]
    keep = [r for r in recs if len(render_record(xtml, r, cfg.sft.mode)[0]) <= cfg.sft.max_len]
    by_kind = Counter(f"{r['judged_family']}/{r['kind']}" for r in keep)
    return keep, {"pairs": len(train), "records": len(keep), "too_long": len(recs) - len(keep), "by_kind": dict(sorted(by_kind.items()))}


def evaluate_recipe_judge(cfg: Any, model_dir: Any, metrics: Any = None, *, tag: str = "sft") -> dict[str, Any]:
    """The model in ``model_dir`` as RL runs it as the judge (`EngineJudge.from_checkpoint` with ``rl.rollout.slots``,
    ``rl.rollout.engine``, QAT as ``qat.enabled``, its default sampling) on the recipe's held-out pairs
    (`recipe_judge_pairs`), by `evaluate_judge`; one metrics row of stage ``judge/<tag>``."""
    from k3post.rewards.grm import EngineJudge

    _, held = recipe_judge_pairs(cfg.data, cfg.run.seed)
    judge = EngineJudge.from_checkpoint(model_dir, qat=cfg.qat.enabled, max_batch_size=cfg.rl.rollout.slots, seed=cfg.run.seed,
                                        engine=cfg.rl.rollout.engine)
    try:
        res = evaluate_judge(judge, held)
    finally:
        judge.close()
    res["model"] = tag
    res["sampling"] = "as the RL judge samples: temperature 1.0, up to 512 tokens a turn, one attempt"
    if metrics is not None:
        row = {"n": res["n"], "valid_rate": res["valid"]["rate"], "valid_lo": res["valid"]["ci95"][0],
               "valid_hi": res["valid"]["ci95"][1], "agreement": res["agreement"]["rate"],
               "agreement_lo": res["agreement"]["ci95"][0], "agreement_hi": res["agreement"]["ci95"][1],
               "agreement_valid": res["agreement_valid"]["rate"], "ties": res["ties"], "picks_a": res["picks_a"]}
        metrics.log(f"judge/{tag}", 0, row)
    return res
