"""Multi-stage verification of synthesized samples (SPEC §2), with a per-stage funnel.

Each stage is a small function ``stage(sample, ctx) -> StageResult`` with status ``keep``,
``reject`` or ``uncertain`` and a short ``reason`` category (counted in the `Funnel`) plus a
human-readable ``detail``:

1. `structure_stage` - the record is well formed (roles, declared tools), renders to valid XTML
   that parses back to the same assistant messages, calls only declared tools, and every call's
   arguments are a JSON object valid against the tool's JSON Schema.
2. `outcome_stage`   - the environment verifier's verdict on the final state (recorded at synthesis,
   or recomputed by replaying the assistant turns in a fresh environment). Full reward keeps;
   a partial reward is uncertain (to review) by default; zero rejects.
3. `quality_stage`   - effort budget (SPEC §3.3's count: thinking tokens for general tasks, all
   output tokens for agentic ones), no repetition loop, no exact duplicate (content hash) and no
   near duplicate (word-shingle Jaccard through a hashed-shingle inverted index).
4. `judge_stage`     - for non-verifiable families only: a pluggable `Judge` (the GRM plugs in here);
   a rule-based `WritingRuleJudge` is the default for ``general.writing``. Non-verifiable samples
   with no judge, or a judge that is unsure, are uncertain.

A sample runs through all stages in order and stops at the first reject; an uncertain stage does
not stop it (a later stage may still reject it, e.g. as a duplicate). Its final status is reject,
else uncertain if any stage was, else keep. Uncertain samples go to the review queue
(`k3post.synth.review`); only kept or human-accepted samples reach training.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from k3post.envs.episode import offered_tools
from k3post.synth.samples import find_family, replay_sample

__all__ = [
    "KEEP",
    "REJECT",
    "UNCERTAIN",
    "StageResult",
    "StageCounts",
    "Funnel",
    "VerifyConfig",
    "VerifyContext",
    "VerifyReport",
    "Judge",
    "JudgeResult",
    "WritingRuleJudge",
    "Deduper",
    "structure_stage",
    "outcome_stage",
    "quality_stage",
    "judge_stage",
    "STAGES",
    "verify_samples",
    "verify_one",
    "repetition_loop",
    "effort_budget",
    "content_hash",
    "structure_tokenizer",
]

KEEP, REJECT, UNCERTAIN = "keep", "reject", "uncertain"
_STATUSES = (KEEP, REJECT, UNCERTAIN)


@dataclass(frozen=True)
class StageResult:
    """One stage's decision on one sample.

    Attributes:
        status: ``keep`` | ``reject`` | ``uncertain``.
        reason: short category counted in the funnel (``invalid_xtml``, ``over_budget`` ...); "ok" when kept.
        detail: human-readable explanation (shown to reviewers).
    """

    status: str
    reason: str = "ok"
    detail: str = ""

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"StageResult.status must be one of {_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"status": self.status, "reason": self.reason, "detail": self.detail}


def _keep(reason: str = "ok", detail: str = "") -> StageResult:
    return StageResult(KEEP, reason, detail)


def _reject(reason: str, detail: str = "") -> StageResult:
    return StageResult(REJECT, reason, detail)


def _unsure(reason: str, detail: str = "") -> StageResult:
    return StageResult(UNCERTAIN, reason, detail)


# --------------------------------------------------------------------------- funnel


@dataclass
class StageCounts:
    """Counters of one stage: samples seen, kept / rejected / uncertain, and reasons per status."""

    name: str
    seen: int = 0
    kept: int = 0
    rejected: int = 0
    uncertain: int = 0
    reasons: dict[str, Counter] = field(default_factory=lambda: {REJECT: Counter(), UNCERTAIN: Counter()})

    def add(self, result: StageResult) -> None:
        """Count one result."""
        self.seen += 1
        if result.status == KEEP:
            self.kept += 1
        elif result.status == REJECT:
            self.rejected += 1
            self.reasons[REJECT][result.reason] += 1
        else:
            self.uncertain += 1
            self.reasons[UNCERTAIN][result.reason] += 1


class Funnel:
    """Per-stage counters plus the final tally; `table` prints them, `to_dict` feeds the report."""

    def __init__(self, stage_names: Sequence[str] = ()) -> None:
        self.stages: dict[str, StageCounts] = {n: StageCounts(n) for n in stage_names}
        self.total = 0
        self.final: Counter = Counter()

    def record(self, stage: str, result: StageResult) -> None:
        """Count ``result`` under ``stage``."""
        self.stages.setdefault(stage, StageCounts(stage)).add(result)

    def finish(self, status: str) -> None:
        """Count one sample's final status."""
        self.total += 1
        self.final[status] += 1

    def merge(self, other: "Funnel") -> "Funnel":
        """Add ``other``'s counts into this funnel (returns self)."""
        for name, c in other.stages.items():
            mine = self.stages.setdefault(name, StageCounts(name))
            mine.seen += c.seen
            mine.kept += c.kept
            mine.rejected += c.rejected
            mine.uncertain += c.uncertain
            for k in (REJECT, UNCERTAIN):
                mine.reasons[k].update(c.reasons[k])
        self.total += other.total
        self.final.update(other.final)
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"total", "kept", "uncertain", "rejected", "stages": [{name, seen, kept, ...}]}``."""
        return {
            "total": self.total,
            "kept": self.final[KEEP],
            "uncertain": self.final[UNCERTAIN],
            "rejected": self.final[REJECT],
            "stages": [
                {
                    "name": c.name,
                    "seen": c.seen,
                    "kept": c.kept,
                    "rejected": c.rejected,
                    "uncertain": c.uncertain,
                    "reject_reasons": dict(c.reasons[REJECT].most_common()),
                    "uncertain_reasons": dict(c.reasons[UNCERTAIN].most_common()),
                }
                for c in self.stages.values()
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Funnel":
        """Inverse of `to_dict`."""
        f = cls()
        f.total = int(data.get("total", 0))
        for k in (KEEP, UNCERTAIN):
            f.final[k] = int(data.get("kept" if k == KEEP else k, 0))
        f.final[REJECT] = int(data.get("rejected", 0))
        for s in data.get("stages", []):
            c = StageCounts(s["name"], s["seen"], s["kept"], s["rejected"], s["uncertain"])
            c.reasons[REJECT].update(s.get("reject_reasons", {}))
            c.reasons[UNCERTAIN].update(s.get("uncertain_reasons", {}))
            f.stages[c.name] = c
        return f

    def table(self) -> str:
        """A plain-text table: one row per stage (in / kept / rejected / uncertain / top reasons) and a total."""
        rows = [("stage", "in", "kept", "rejected", "uncertain", "reasons")]
        for c in self.stages.values():
            why = [f"{r}×{n}" for r, n in c.reasons[REJECT].most_common(3)]
            why += [f"?{r}×{n}" for r, n in c.reasons[UNCERTAIN].most_common(2)]
            rows.append((c.name, str(c.seen), str(c.kept), str(c.rejected), str(c.uncertain), ", ".join(why)))
        rows.append(("final", str(self.total), str(self.final[KEEP]), str(self.final[REJECT]), str(self.final[UNCERTAIN]), "uncertain → review queue"))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = []
        for k, r in enumerate(rows):
            lines.append("  ".join(v.ljust(widths[i]) if i in (0, 5) else v.rjust(widths[i]) for i, v in enumerate(r)).rstrip())
            if k == 0 or k == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


# --------------------------------------------------------------------------- config, judge, context


@dataclass
class VerifyConfig:
    """Thresholds of the verification stages (defaults are ours).

    ``budgets`` maps ``effort`` or ``domain/effort`` to a token budget (the more specific key wins):
    a sample whose SPEC §3.3 token count (general: thinking tokens; agents / coding: all output
    tokens across turns) exceeds it is rejected. The defaults are generous caps over the built-in
    families' reference traces: with the demo's 512-token BPE the longest general thinking is
    ~190 tokens at ``max``, and agentic output ~820 at ``low`` (tool-call tokens do not shrink
    with effort) and ~1,240 at ``max``.
    """

    budgets: dict[str, int] = field(
        default_factory=lambda: {
            "low": 512, "high": 2048, "max": 8192,
            "agents/low": 2048, "agents/high": 4096, "coding/low": 2048, "coding/high": 4096,
        }
    )
    keep_reward: float = 1.0  # outcome: reward >= this keeps
    partial_reward: str = "review"  # outcome: 0 < reward < keep_reward → "review" (uncertain) or "reject"
    repeat_ngram: int = 8  # repetition loop: an n-gram of this many words ...
    repeat_max: int = 3  # ... occurring more than this many times in one field is a loop
    near_dup_threshold: float = 0.9  # word-shingle Jaccard at or above this is a near duplicate
    shingle_words: int = 3  # words per shingle
    postings_cap: int = 64  # shingles shared by more kept samples than this are boilerplate, not evidence
    judge_keep: float = 0.6  # judge: score >= this keeps (unless the judge says it is unsure)
    judge_verifiable: bool = False  # also judge verifiable families
    max_total_tokens: int = 0  # quality: a rendered sample longer than this is rejected (the trainer's max_len); 0 = no cap

    def __post_init__(self) -> None:
        for k, v in self.budgets.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"verify.budgets['{k}'] must be a positive int, got {v!r}")
        if self.partial_reward not in ("review", "reject"):
            raise ValueError(f"verify.partial_reward must be 'review' or 'reject', got {self.partial_reward!r}")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError(f"verify.near_dup_threshold must be in (0, 1], got {self.near_dup_threshold!r}")
        for name in ("repeat_ngram", "repeat_max", "shingle_words", "postings_cap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"verify.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class JudgeResult:
    """A judge's opinion: ``score`` in [0, 1], whether it is ``uncertain``, and a ``note`` for reviewers."""

    score: float
    uncertain: bool = False
    note: str = ""


@runtime_checkable
class Judge(Protocol):
    """Scores a sample of a non-verifiable family (the GRM of SPEC §3.4 implements this)."""

    def judge(self, sample: Mapping[str, Any]) -> JudgeResult:
        """Score ``sample`` (a synthesized record with ``messages``, ``task`` ...)."""
        ...


_FILLER = (
    "great choice for everyone",
    "high quality",
    "best product",
    "you will love it",
    "must-have",
    "look no further",
    "in today's world",
    "game changer",
    "game-changer",
)


class WritingRuleJudge:
    """A rule-based judge for ``general.writing`` blurbs until the GRM plugs in.

    Checks (each pass/fail): the family's format gate (two sentences, names the product, mentions
    the feature, 12..60 words, original), lexical variety (distinct / all words >= 0.6), no
    marketing filler phrase, the two sentences start differently, and neither sentence exceeds 35
    words. ``score`` is the fraction passed; all passed keeps, a failed soft check (variety,
    filler, openings, sentence length) with the format gate intact is uncertain (a human decides),
    and a failed format gate caps the score at 0.5, below the default `VerifyConfig.judge_keep`.
    """

    def judge(self, sample: Mapping[str, Any]) -> JudgeResult:
        """Score the final response of a writing sample."""
        from k3post.envs.families.general.family import writing_format_check

        task = sample.get("task") or {}
        meta = task.get("metadata") or {}
        if "product" not in meta or "feature" not in meta:
            return JudgeResult(0.0, True, "not a general.writing sample (no product / feature in task metadata)")
        text = _final_response(sample.get("messages") or [])
        prompt = "\n\n".join(m.get("content") or "" for m in task.get("messages") or [] if m.get("role") in ("system", "user"))
        fmt = writing_format_check(text, meta["product"], meta["feature"], prompt)
        words = re.findall(r"[a-z0-9']+", text.lower())
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]
        soft = {
            "variety": float(bool(words) and len(set(words)) / len(words) >= 0.6),
            "no_filler": float(not any(f in text.lower() for f in _FILLER)),
            "distinct_openings": float(len({s.split()[0].lower() for s in sentences if s.split()}) == len(sentences)),
            "sentence_length": float(all(len(s.split()) <= 35 for s in sentences)),
        }
        checks = {**fmt, **soft}
        score = sum(checks.values()) / len(checks)
        failed = [k for k, v in checks.items() if v < 1]
        format_ok = all(v == 1 for v in fmt.values())
        uncertain = format_ok and bool(failed)
        note = "all rule checks pass" if not failed else "failed: " + ", ".join(failed)
        return JudgeResult(score if format_ok else min(score, 0.5), uncertain, note)


def _final_response(messages: Sequence[Mapping[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "assistant":
            c = m.get("content")
            return c if isinstance(c, str) else ""
    return ""


_STRUCT_TOKENIZER: Any = None


def structure_tokenizer() -> Any:
    """A byte-level tokenizer with the XTML tokens and no merges: enough to check XTML structure
    when no run tokenizer is given (validity does not depend on the merges)."""
    global _STRUCT_TOKENIZER
    if _STRUCT_TOKENIZER is None:
        from k3post.tokenizer import train_tokenizer

        _STRUCT_TOKENIZER = train_tokenizer([], vocab_size=262)
    return _STRUCT_TOKENIZER


def _default_judges() -> dict[str, Judge]:
    return {"general.writing": WritingRuleJudge()}


class VerifyContext:
    """What the stages share: config, the XTML codec, judges, family lookup and the dedup index."""

    def __init__(
        self,
        config: VerifyConfig | None = None,
        *,
        tokenizer: Any = None,
        judges: Mapping[str, Judge] | None = None,
        family_lookup: Callable[[str], Any] | None = None,
        mode: str = "think",
    ) -> None:
        """Args:
            config: thresholds (default `VerifyConfig()`).
            tokenizer: the run's tokenizer (default: `structure_tokenizer`).
            judges: family name → `Judge` (default: `WritingRuleJudge` for ``general.writing``);
                ``"*"`` is used for any non-verifiable family without its own.
            family_lookup: name → TaskFamily or None (default `k3post.synth.samples.find_family`).
            mode: XTML mode of the samples.
        """
        from k3post.xtml import XTML

        self.config = config or VerifyConfig()
        self.xtml = XTML(tokenizer if tokenizer is not None else structure_tokenizer())
        self.judges: dict[str, Judge] = dict(_default_judges() if judges is None else judges)
        if family_lookup is None:
            family_lookup = find_family
        self.family_lookup = family_lookup
        self.mode = mode
        self.dedup = Deduper(self.config.shingle_words, self.config.near_dup_threshold, self.config.postings_cap)
        self._validators: dict[str, Any] = {}

    def validator(self, schema: Mapping[str, Any]) -> Any:
        """A checked JSON Schema validator for ``schema`` (cached; raises jsonschema.SchemaError if invalid)."""
        from jsonschema import validators

        key = json.dumps(schema, sort_keys=True)
        v = self._validators.get(key)
        if v is None:
            cls = validators.validator_for(schema)
            cls.check_schema(schema)
            v = self._validators[key] = cls(schema)
        return v

    def family(self, name: str | None) -> Any:
        """The family named ``name`` or None when unknown."""
        if not name:
            return None
        try:
            return self.family_lookup(name)
        except ValueError:
            return None


# --------------------------------------------------------------------------- stage 1: structure


def _arguments(call: Mapping[str, Any]) -> tuple[Any, str | None]:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return None, f"arguments are not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(args, dict):
        return None, f"arguments must be a JSON object, got {type(args).__name__}"
    return args, None


def _same_message(orig: Mapping[str, Any], parsed: Mapping[str, Any], reasoning: bool = True) -> str | None:
    if reasoning and (orig.get("reasoning_content") or "") != (parsed.get("reasoning_content") or ""):
        return "reasoning differs"
    if (orig.get("content") or "") != (parsed.get("content") or ""):
        return "content differs"
    oc, pc = orig.get("tool_calls") or [], parsed.get("tool_calls") or []
    if len(oc) != len(pc):
        return f"{len(oc)} calls written, {len(pc)} parsed"
    for a, b in zip(oc, pc):
        if (a.get("function") or {}).get("name") != b["function"]["name"] or _arguments(a)[0] != _arguments(b)[0]:
            return f"call {b['function']['name']!r} differs"
    return None


def structure_stage(sample: Mapping[str, Any], ctx: VerifyContext) -> StageResult:
    """Valid record, valid XTML that round-trips, declared tools only, arguments valid per JSON Schema."""
    from jsonschema import SchemaError

    from k3post.data import check_record

    if sample.get("error"):
        return _reject("teacher_error", str(sample["error"]))
    msgs = sample.get("messages")
    tools_in = sample.get("tools") or []
    if isinstance(msgs, list) and isinstance(tools_in, list) and all(isinstance(m, dict) for m in msgs + tools_in):
        declared = {(t.get("function") or t).get("name") for t in offered_tools(msgs, tools_in)}
        for i, m in enumerate(msgs):
            for j, call in enumerate(m.get("tool_calls") or [] if m.get("role") == "assistant" else []):
                name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
                if name not in declared:
                    return _reject("undeclared_tool", f"messages[{i}].tool_calls[{j}]: tool {name!r} is not declared; declared: {sorted(n for n in declared if n)}")
    try:
        check_record(sample)
    except ValueError as e:
        return _reject("invalid_record", str(e))
    msgs = list(sample["messages"])
    asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if not asst:
        return _reject("no_assistant_turn", "the trajectory has no assistant message")
    for i in asst:
        if msgs[i].get("xtml_error"):
            return _reject("unparseable_completion", f"messages[{i}]: {msgs[i]['xtml_error']}")
    tools = {(t.get("function") or t)["name"]: (t.get("function") or t) for t in offered_tools(msgs, sample.get("tools") or [])}
    for i in asst:
        for j, call in enumerate(msgs[i].get("tool_calls") or []):
            name = (call.get("function") or {}).get("name")
            args, err = _arguments(call)
            if err:
                return _reject("bad_arguments", f"messages[{i}].tool_calls[{j}] ({name}): {err}")
            schema = tools[name].get("parameters") or {"type": "object"}
            try:
                validator = ctx.validator(schema)
            except SchemaError as e:
                return _reject("bad_tool_schema", f"tool {name!r} has an invalid JSON Schema: {e.message}")
            errors = sorted(validator.iter_errors(args), key=lambda e: list(e.path))
            if errors:
                where = "/".join(str(p) for p in errors[0].path) or "(root)"
                return _reject("arguments_schema", f"messages[{i}].tool_calls[{j}] ({name}) at {where}: {errors[0].message}")
    try:
        r = ctx.xtml.render(msgs, tools=sample.get("tools") or None, effort=sample.get("effort"), mode=ctx.mode)
    except ValueError as e:
        return _reject("unrenderable", str(e))
    v = ctx.xtml.validate(r.ids, mode=ctx.mode)
    if not v.ok:
        return _reject("invalid_xtml", f"token {v.position}: {v.message}")
    for i in asst:
        ids = [t for t, k in zip(r.ids, r.message_index) if k == i]
        try:
            parsed = ctx.xtml.parse(ids, mode=ctx.mode)
        except ValueError as e:
            return _reject("xtml_roundtrip", f"messages[{i}] does not parse back: {e}")
        diff = _same_message(msgs[i], parsed, reasoning=ctx.mode == "think")  # instruct mode drops reasoning
        if diff:
            return _reject("xtml_roundtrip", f"messages[{i}] parses back differently: {diff}")
    return _keep()


# --------------------------------------------------------------------------- stage 2: outcome


def outcome_stage(sample: Mapping[str, Any], ctx: VerifyContext) -> StageResult:
    """The environment verifier's reward: full keeps, partial is uncertain (or rejected), zero rejects.

    Uses the verdict recorded at synthesis; without one (imported or edited data) the assistant
    turns are replayed in a fresh environment of the task's family (`replay_sample`), and the
    replayed tool results must equal the recorded ones.
    """
    if sample.get("truncated"):
        return _reject("truncated", f"the episode hit a limit ({sample.get('truncation')}) before it finished")
    verdict = sample.get("verdict")
    if verdict is None:
        fam = ctx.family(sample.get("family"))
        if fam is None or not sample.get("task"):
            return _unsure("no_verdict", "no recorded verdict and no known family to replay the episode in")
        try:
            ep = replay_sample(sample, fam)
        except ValueError as e:
            return _reject("replay_failed", str(e))
        mismatch = _transcript_mismatch(sample["messages"], ep.messages)
        if mismatch:
            return _reject("transcript_mismatch", mismatch)
        if ep.truncated:
            return _reject("truncated", f"the replayed episode hit a limit ({ep.truncation})")
        assert ep.verdict is not None
        verdict = ep.verdict.to_dict()
    reward = float(verdict["reward"])
    diag = str(verdict.get("diagnostics", ""))[:300]
    if reward >= ctx.config.keep_reward:
        return _keep()
    if reward > 0 and ctx.config.partial_reward == "review":
        return _unsure("partial_reward", f"reward {reward:.3g} < {ctx.config.keep_reward:g}: {diag}")
    return _reject("verifier_failed", f"reward {reward:.3g}: {diag}")


def _transcript_mismatch(recorded: Sequence[Mapping[str, Any]], replayed: Sequence[Mapping[str, Any]]) -> str | None:
    def env_side(ms: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any]]:
        return [(m.get("role"), m.get("content")) for m in ms if m.get("role") != "assistant"]

    a, b = env_side(recorded), env_side(replayed)
    if a == b:
        return None
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"non-assistant message {k} ({x[0]}) differs from what the environment returns: {str(x[1])[:80]!r} vs {str(y[1])[:80]!r}"
    return f"{len(a)} non-assistant messages recorded, the environment produces {len(b)}"


# --------------------------------------------------------------------------- stage 3: quality


def effort_budget(budgets: Mapping[str, int], domain: str, effort: str | None) -> int | None:
    """The budget for (domain, effort): key ``domain/effort`` beats ``effort``; None when neither is set."""
    if effort is None:
        return None
    for key in (f"{domain}/{effort}", effort):
        if key in budgets:
            return int(budgets[key])
    return None


_WORD = re.compile(r"\S+")


def repetition_loop(text: str, n: int = 8, max_count: int = 3) -> str | None:
    """The first word n-gram occurring more than ``max_count`` times in ``text``, or None.

    Counts every position (overlapping), so a loop of a short phrase repeated many times is
    caught too: ``"a b " * 20`` with n=8 contains the 8-gram "a b a b a b a b" nine times.
    """
    words = _WORD.findall(text)
    if len(words) < n * (max_count + 1):
        return None
    counts: Counter = Counter()
    for i in range(len(words) - n + 1):
        g = tuple(words[i : i + n])
        counts[g] += 1
        if counts[g] > max_count:
            return " ".join(g)
    return None


def content_hash(sample: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of what is trained on: messages (role, reasoning, content, calls), tools, effort."""
    keep = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "type", "tools")
    msgs = [{k: m[k] for k in keep if m.get(k) not in (None, "", [])} for m in sample.get("messages") or []]
    blob = json.dumps([msgs, sample.get("tools") or [], sample.get("effort")], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sample_text(sample: Mapping[str, Any]) -> str:
    parts: list[str] = []
    for m in sample.get("messages") or []:
        for k in ("reasoning_content", "content"):
            if isinstance(m.get(k), str):
                parts.append(m[k])
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            a = fn.get("arguments", "")
            parts.append(f"{fn.get('name', '')} {a if isinstance(a, str) else json.dumps(a, sort_keys=True)}")
    return "\n".join(parts)


class Deduper:
    """Exact (content hash) and near-duplicate (word-shingle Jaccard) detection, per effort bucket.

    Near duplicates: each sample's text becomes a set S of hashed ``k``-word shingles. An inverted
    index maps shingle → kept samples holding it. A new sample's candidates are the kept samples
    sharing one of its shingles whose posting list holds at most ``postings_cap`` samples (a
    shingle shared by more is template boilerplate, e.g. a family's fixed instruction, and is
    no evidence of duplication; true near duplicates share their specific shingles too). For
    each candidate the exact Jaccard |S∩T| / |S∪T| is computed; at or above ``threshold`` the
    sample is a near duplicate. Cost is O(|S| · postings_cap) per sample, O(n·k) overall.
    Only kept samples are indexed. Samples of different effort levels never collide (the same
    task at three efforts is intended).
    """

    def __init__(self, shingle_words: int = 3, threshold: float = 0.9, postings_cap: int = 64) -> None:
        self.k = shingle_words
        self.threshold = threshold
        self.cap = postings_cap
        self.hashes: dict[str, str] = {}  # content hash → sample id
        self.sets: list[frozenset[int]] = []
        self.ids: list[str] = []
        self.index: dict[tuple[str, int], list[int]] = {}

    def shingles(self, text: str) -> frozenset[int]:
        """Hashed ``k``-word shingles of ``text`` (lower-cased; a text shorter than k words is one shingle)."""
        w = text.lower().split()
        grams = [" ".join(w[i : i + self.k]) for i in range(max(1, len(w) - self.k + 1))]
        return frozenset(int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams)

    def check(self, sample: Mapping[str, Any], add: bool = True) -> StageResult:
        """Whether ``sample`` duplicates a kept one; if not and ``add``, index it."""
        sid = str(sample.get("id", len(self.ids)))
        bucket = str(sample.get("effort"))
        h = content_hash(sample)
        if h in self.hashes:
            return _reject("exact_duplicate", f"same content as {self.hashes[h]}")
        s = self.shingles(_sample_text(sample))
        overlap: Counter = Counter()
        for g in s:
            post = self.index.get((bucket, g))
            if post is not None and len(post) <= self.cap:
                overlap.update(post)
        for j in overlap:
            t = self.sets[j]
            inter = len(s & t)
            jac = inter / (len(s) + len(t) - inter)
            if jac >= self.threshold:
                return _reject("near_duplicate", f"Jaccard {jac:.2f} with {self.ids[j]}")
        if add:
            j = len(self.sets)
            self.hashes[h] = sid
            self.sets.append(s)
            self.ids.append(sid)
            for g in s:
                self.index.setdefault((bucket, g), []).append(j)
        return _keep()


def quality_stage(sample: Mapping[str, Any], ctx: VerifyContext) -> StageResult:
    """Within the effort budget, no repetition loop, not an exact or near duplicate of a kept sample."""
    cfg = ctx.config
    domain = str(sample.get("domain") or "general")
    budget = effort_budget(cfg.budgets, domain, sample.get("effort"))
    tokens = sample.get("tokens") or {}
    measure = "reasoning" if domain == "general" else "output"
    used = tokens.get(measure)
    if budget is not None and isinstance(used, int) and used > budget:
        return _reject("over_budget", f"{used} {measure} tokens > {sample.get('effort')} budget {budget} ({domain})")
    total = tokens.get("total")
    if cfg.max_total_tokens > 0 and isinstance(total, int) and total > cfg.max_total_tokens:
        return _reject("too_long", f"{total} tokens > max_total_tokens {cfg.max_total_tokens} (the trainer's max_len)")
    for i, m in enumerate(sample.get("messages") or []):
        if m.get("role") != "assistant":
            continue
        fields = [("reasoning", m.get("reasoning_content")), ("content", m.get("content"))]
        fields += [(f"call {k}", (c.get("function") or {}).get("arguments")) for k, c in enumerate(m.get("tool_calls") or [])]
        for name, text in fields:
            if isinstance(text, str):
                loop = repetition_loop(text, cfg.repeat_ngram, cfg.repeat_max)
                if loop:
                    return _reject("repetition_loop", f"messages[{i}] {name}: {loop[:80]!r} repeats more than {cfg.repeat_max} times")
    return ctx.dedup.check(sample)


# --------------------------------------------------------------------------- stage 4: judge


def judge_stage(sample: Mapping[str, Any], ctx: VerifyContext) -> StageResult:
    """For non-verifiable families: the family's judge (or ``"*"``); none, or an unsure judge, is uncertain."""
    fam = ctx.family(sample.get("family"))
    verifiable = bool(getattr(fam, "verifiable", sample.get("verifiable", True)))
    if verifiable and not ctx.config.judge_verifiable:
        return _keep("verifiable", "verifiable family: no judge needed")
    judge = ctx.judges.get(str(sample.get("family"))) or ctx.judges.get("*")
    if judge is None:
        return _unsure("no_judge", f"non-verifiable family {sample.get('family')!r} and no judge configured")
    res = judge.judge(sample)
    if res.uncertain:
        return _unsure("judge_uncertain", f"score {res.score:.2f}: {res.note}")
    if res.score >= ctx.config.judge_keep:
        return _keep("ok", f"score {res.score:.2f}: {res.note}")
    return _reject("judge_low_score", f"score {res.score:.2f} < {ctx.config.judge_keep:g}: {res.note}")


Stage = Callable[[Mapping[str, Any], VerifyContext], StageResult]
STAGES: tuple[tuple[str, Stage], ...] = (
    ("structure", structure_stage),
    ("outcome", outcome_stage),
    ("quality", quality_stage),
    ("judge", judge_stage),
)
"""The stages in order, by name."""


# --------------------------------------------------------------------------- driver


@dataclass
class VerifyReport:
    """The outcome of `verify_samples`.

    ``kept``: samples that passed every stage. ``uncertain``: ``(sample, flags)`` where flags are
    ``[{"stage", "status", "reason", "detail"}]`` of the uncertain stages. ``rejected``:
    ``(sample, flag)`` of the rejecting stage.
    """

    kept: list[dict[str, Any]]
    uncertain: list[tuple[dict[str, Any], list[dict[str, str]]]]
    rejected: list[tuple[dict[str, Any], dict[str, str]]]
    funnel: Funnel


def verify_one(
    sample: Mapping[str, Any], ctx: VerifyContext, stages: Sequence[tuple[str, Stage]] = STAGES, funnel: Funnel | None = None
) -> tuple[str, list[dict[str, str]]]:
    """Run ``sample`` through ``stages``; returns its final status and the non-keep flags."""
    flags: list[dict[str, str]] = []
    status = KEEP
    for name, stage in stages:
        res = stage(sample, ctx)
        if funnel is not None:
            funnel.record(name, res)
        if res.status != KEEP:
            flags.append({"stage": name, **res.to_dict()})
        if res.status == REJECT:
            status = REJECT
            break
        if res.status == UNCERTAIN:
            status = UNCERTAIN
    if funnel is not None:
        funnel.finish(status)
    return status, flags


def verify_samples(
    samples: Iterable[Mapping[str, Any]], ctx: VerifyContext | None = None, stages: Sequence[tuple[str, Stage]] = STAGES
) -> VerifyReport:
    """Verify every sample in order (dedup keeps the first of duplicates); returns kept / uncertain / rejected and the funnel."""
    ctx = ctx or VerifyContext()
    funnel = Funnel([n for n, _ in stages])
    rep = VerifyReport([], [], [], funnel)
    for s in samples:
        status, flags = verify_one(s, ctx, stages, funnel)
        if status == KEEP:
            rep.kept.append(dict(s))
        elif status == UNCERTAIN:
            rep.uncertain.append((dict(s), flags))
        else:
            rep.rejected.append((dict(s), flags[-1]))
    return rep
