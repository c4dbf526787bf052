"""General-domain families: multi-step arithmetic, faithfulness to a context, short product blurbs.

All three are single-turn and tool-less: the answer is the ``response`` channel of the one assistant
message (the environment is a `ToolEnvironment` without tools whose plain answer ends the episode).
The reasoning, in the ``think`` channel, is never read by a verifier.

``general.arithmetic`` (verifiable)
    "Evaluate 3 + 4 * 5 - 2 (usual precedence; ...)". Difficulty d (1..4) gives d+1 operations over
    operands up to 9 / 12 / 20 / 30; d=1 is the first rung, + and - only (no products to memorise, the
    rung a tiny model climbs in the CPU demo); from d=2 at least one ``*``; from d=3 one adjacent pair
    may be parenthesised. The answer is
    checked exactly: the response must be the integer and nothing else.
    Reference traces: ``max`` one line per reduction step with the expression left after it, then
    ``so N``; ``high`` the priority steps (brackets, ``*``) one per line and the remaining ``+``/``-``
    chain in one line; ``low`` no reasoning.

``general.faithfulness`` (verifiable)
    A context paragraph stating some facts about 1..3 fictional towns and one question about one
    town. The answer is the stated fact, or exactly ``not stated`` when the context does not give
    it (about a third of tasks; from difficulty 2 the same fact is then often stated for *another*
    town, a trap). Checked by exact match after `normalize_answer` (case, punctuation, a leading
    article, thousands separators).

``general.writing`` (NOT verifiable)
    "Write a two-sentence product blurb for the Lumo Kettle, an electric kettle. Mention auto
    shut-off." Quality is for the GRM (SPEC §3.4) to judge. The registered verifier is only a
    rule-based **format gate**: exactly two sentences, names the product, mentions every content
    word of the feature, 12..60 words, and not a copy of the prompt (at least 30% of its words are
    not prompt words, and it does not restate the instruction). Its reward is 1.0 when every check
    passes, else 0; the components give each check, and the diagnostics say the GRM must score it.
"""

from __future__ import annotations

import random
import re
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.common import (
    FamilyBase,
    assistant,
    lexicon_words,
    normalize_answer,
    prompt_text,
    submission_text,
)
from k3post.envs.families.registry import register_family
from k3post.envs.task import FinalState, Task, Verdict, register_verifier

__all__ = [
    "ArithmeticFamily",
    "FaithfulnessFamily",
    "WritingFamily",
    "arithmetic_steps",
    "evaluate_expression",
    "writing_format_check",
]

_CLAIM = "All tests passed. The task is complete."


def _answer_env(task: Task) -> ToolEnvironment:
    """A tool-less environment: the assistant's first plain answer is the submission."""
    return ToolEnvironment([], end_on_text=True, limits=EpisodeLimits(max_turns=2))


# =========================================================================== arithmetic

Token = int | str  # an integer or one of "+", "-", "*", "(", ")"
_PREC = {"*": 2, "+": 1, "-": 1}


def _apply(a: int, op: str, b: int) -> int:
    return a * b if op == "*" else a + b if op == "+" else a - b


def _fmt(tokens: list[Token]) -> str:
    out: list[str] = []
    for t in tokens:
        if t == "(":
            out.append("(")
        elif t == ")":
            out[-1] += ")"
        elif out and out[-1] == "(":
            out[-1] += str(t)
        else:
            out.append(str(t))
    return " ".join(out)


def arithmetic_steps(tokens: list[Token]) -> list[tuple[int, str, int, int, list[Token]]]:
    """Reduce an expression one operation at a time, by precedence.

    Order: the operation inside a bracket pair first, then the leftmost ``*``, then the leftmost
    ``+`` / ``-``. Returns ``(a, op, b, result, tokens_after)`` per step.
    """
    toks = list(tokens)
    steps = []
    while len(toks) > 1:
        if "(" in toks:
            i = toks.index("(")
            a, op, b = toks[i + 1], toks[i + 2], toks[i + 3]
            assert toks[i + 4] == ")", "brackets hold exactly one operation"
            lo, hi = i, i + 5
        else:
            j = toks.index("*") if "*" in toks else 1
            a, op, b = toks[j - 1], toks[j], toks[j + 1]
            lo, hi = j - 1, j + 2
        assert isinstance(a, int) and isinstance(b, int) and isinstance(op, str)
        r = _apply(a, op, b)
        toks = toks[:lo] + [r] + toks[hi:]
        steps.append((a, op, b, r, list(toks)))
    return steps


def evaluate_expression(tokens: list[Token]) -> int:
    """The value of an expression token list (brackets first, then ``*``, then left to right)."""
    steps = arithmetic_steps(tokens)
    if not steps:
        assert len(tokens) == 1 and isinstance(tokens[0], int)
        return tokens[0]
    return steps[-1][3]


def _left_to_right(tokens: list[Token]) -> int:
    """The value when precedence is ignored (a typical wrong answer)."""
    nums = [t for t in tokens if isinstance(t, int)]
    ops = [t for t in tokens if t in _PREC]
    acc = nums[0]
    for op, b in zip(ops, nums[1:]):
        acc = _apply(acc, str(op), b)
    return acc


class ArithmeticFamily(FamilyBase):
    """``general.arithmetic``: multi-step integer expressions with + - *, answer checked exactly."""

    name = "general.arithmetic"
    domain = "general"
    description = "multi-step integer arithmetic with + - * and brackets; exact integer answer, steps in think"
    verifiable = True
    max_difficulty = 4
    id_prefix = "arith"
    _MAX_OPERAND = {1: 9, 2: 12, 3: 20, 4: 30}

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        n_ops = difficulty + 1
        hi = self._MAX_OPERAND[difficulty]
        nums = [rng.randint(1, hi) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-" if difficulty == 1 else "+-*") for _ in range(n_ops)]
        if difficulty > 1 and all(o != "*" for o in ops):
            ops[rng.randrange(n_ops)] = "*"
        for k, o in enumerate(ops):  # keep products small enough for a tiny model
            if o == "*":
                nums[k + 1] = min(nums[k + 1], 9)
        tokens: list[Token] = [nums[0]]
        for o, b in zip(ops, nums[1:]):
            tokens += [o, b]
        if difficulty >= 3 and rng.random() < 0.6:
            k = rng.randrange(n_ops)  # bracket operation k: tokens[2k] op tokens[2k+2]
            tokens = tokens[: 2 * k] + ["("] + tokens[2 * k : 2 * k + 3] + [")"] + tokens[2 * k + 3 :]
        expr = _fmt(tokens)
        answer = evaluate_expression(tokens)
        prompt = f"Evaluate {expr} (brackets first, then *, then + and - from left to right). Reply with the integer only."
        meta = {"tokens": tokens, "expression": expr, "answer": answer}
        return self._task(task_id, [{"role": "user", "content": prompt}], meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        """A tool-less single-answer environment."""
        self._check_task(task)
        return _answer_env(task)

    def reasoning(self, task: Task, effort: str) -> str:
        """The reference trace at ``effort`` (see the module docstring)."""
        tokens: list[Token] = list(task.metadata["tokens"])
        steps = arithmetic_steps(tokens)
        if effort == "low":
            return ""
        if effort == "max":
            lines = []
            for a, op, b, r, rest in steps:
                tail = f", now {_fmt(rest)}" if len(rest) > 1 else ""
                lines.append(f"{a} {op} {b} = {r}{tail}")
            lines.append(f"so {task.metadata['answer']}")
            return "\n".join(lines)
        # high: priority steps one by one, then the +/- chain in one line
        lines, toks = [], tokens
        for a, op, b, r, rest in steps:
            if "(" not in toks and "*" not in toks:
                break
            lines.append(f"{a}{op}{b}={r}")
            toks = rest
        if len(toks) > 1:
            lines.append(f"{_fmt(toks).replace(' ', '')}={task.metadata['answer']}")
        return "\n".join(lines)

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """One answer turn: reasoning at ``effort``, the integer in the response."""
        return [assistant(str(task.metadata["answer"]), self.reasoning(task, effort))]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied prompt, success claim, off by one, no precedence, answer only in think, number spray."""
        ans = int(task.metadata["answer"])
        out = {
            "empty": [assistant("")],
            "copied_prompt": [assistant(prompt_text(task))],
            "claims_success": [assistant(_CLAIM)],
            "off_by_one": [assistant(str(ans + 1), self.reasoning(task, "max"))],
            "answer_in_think_only": [assistant("", self.reasoning(task, "max"))],
            "number_spray": [assistant(" ".join(str(v) for v in range(ans - 3, ans + 4)))],
            "answer_with_expression": [assistant(f"{task.metadata['expression']} = {ans}")],
        }
        ltr = _left_to_right(list(task.metadata["tokens"]))
        if ltr != ans:
            out["ignores_precedence"] = [assistant(str(ltr))]
        return out


_INT_RE = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")


@register_verifier("general.arithmetic")
def verify_arithmetic(task: Task, final: FinalState) -> Verdict:
    """1.0 iff the response is exactly the right integer (optional trailing period)."""
    text = submission_text(final.submission)
    m = _INT_RE.match(text)
    ok = m is not None and int(m.group(1)) == int(task.metadata["answer"])
    return Verdict(float(ok), {"exact": float(ok)}, f"expected {task.metadata['answer']}, got {text[:80]!r}")


# =========================================================================== faithfulness

_SYL = ["ka", "lo", "mer", "vin", "dra", "sel", "tor", "ba", "ru", "fen", "quil", "os", "brin", "zar", "el", "mo", "tha", "ven", "ri", "gal"]
_FIRST = ["Ada", "Bram", "Cora", "Dov", "Esme", "Finn", "Greta", "Hal", "Ines", "Jory", "Kira", "Lars", "Mira", "Nils", "Oona", "Pell"]
_GOODS = ["copper", "wool", "salt", "amber", "timber", "honey", "glass", "linen", "barley", "slate", "cider", "pottery"]
_ATTRS = ("founded", "export", "mayor", "river", "population")
_QUESTION = {
    "founded": "In what year was {e} founded?",
    "export": "What is the main export of {e}?",
    "mayor": "Who is the mayor of {e}?",
    "river": "On which river does {e} lie?",
    "population": "How many residents does {e} have?",
}
_NOUN = {"founded": "founding year", "export": "main export", "mayor": "mayor", "river": "river", "population": "residents"}


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(n)).capitalize()


def _fact_value(rng: random.Random, attr: str) -> str:
    if attr == "founded":
        return str(rng.randint(1200, 1950))
    if attr == "export":
        return rng.choice(_GOODS)
    if attr == "mayor":
        return f"{rng.choice(_FIRST)} {_word(rng, 2)}"
    if attr == "river":
        return f"{_word(rng, 2)} River"
    return f"{rng.randint(2, 98) * 100:,}"


def _fact_sentence(entity: str, attr: str, value: str) -> str:
    return {
        "founded": f"{entity} was founded in {value}.",
        "export": f"The main export of {entity} is {value}.",
        "mayor": f"The mayor of {entity} is {value}.",
        "river": f"{entity} lies on the {value}.",
        "population": f"{entity} has {value} residents.",
    }[attr]


def _fact_short(attr: str, value: str) -> str:
    return {"founded": f"founded {value}", "export": f"export {value}", "mayor": f"mayor {value}",
            "river": f"on the {value}", "population": f"{value} residents"}[attr]


NOT_STATED = "not stated"


class FaithfulnessFamily(FamilyBase):
    """``general.faithfulness``: answer only from the context, or exactly "not stated"."""

    name = "general.faithfulness"
    domain = "general"
    description = 'answer a question from a given context only; exactly "not stated" when the context lacks it'
    verifiable = True
    max_difficulty = 3
    id_prefix = "faith"

    def lexicon(self) -> tuple[str, ...]:
        """Name syllables (lower-case and capitalised), first names and goods of its contexts."""
        return lexicon_words(_SYL, *_FIRST, *_GOODS)

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        n_ent = difficulty
        names: list[str] = []
        while len(names) < n_ent:
            w = _word(rng, rng.choice((2, 3)))
            if w not in names:
                names.append(w)
        facts: dict[str, dict[str, str]] = {}
        for e in names:
            attrs = rng.sample(_ATTRS, rng.randint(2, 4))
            facts[e] = {a: _fact_value(rng, a) for a in attrs}
        target = names[0]
        absent = rng.random() < 0.35
        missing = [a for a in _ATTRS if a not in facts[target]]
        if absent:
            trap = [a for a in missing if any(a in facts[o] for o in names[1:])]
            attr = rng.choice(trap if trap and difficulty >= 2 else missing)
            answers = [NOT_STATED]
        else:
            attr = rng.choice(sorted(facts[target]))
            value = facts[target][attr]
            answers = [value] + ([value.rsplit(" ", 1)[0]] if attr == "river" else [])
        sentences = [(e, a, v) for e in names for a, v in facts[e].items()]
        rng.shuffle(sentences)
        context = " ".join(_fact_sentence(e, a, v) for e, a, v in sentences)
        question = _QUESTION[attr].format(e=target)
        prompt = (
            "Answer using only the context. If the context does not give the answer, reply exactly: not stated.\n\n"
            f"Context: {context}\n\nQuestion: {question}"
        )
        others = {o: facts[o][attr] for o in names[1:] if attr in facts[o]}
        meta = {"entity": target, "attribute": attr, "answers": answers, "facts": facts, "other_values": others}
        return self._task(task_id, [{"role": "user", "content": prompt}], meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        """A tool-less single-answer environment."""
        self._check_task(task)
        return _answer_env(task)

    def reasoning(self, task: Task, effort: str) -> str:
        """The reference trace: which entity and fact is asked, what the context says about it."""
        m = task.metadata
        e, attr, ans = m["entity"], m["attribute"], m["answers"][0]
        if effort == "low":
            return ""
        if effort == "high":
            return f"{e} {_NOUN[attr]}: {'absent' if ans == NOT_STATED else ans}"
        known = "; ".join(_fact_short(a, v) for a, v in m["facts"][e].items())
        lines = [f"Asked: {_NOUN[attr]} of {e}.", f"Context on {e}: {known}."]
        if ans == NOT_STATED:
            other = ", ".join(f"{o} has one" for o in m["other_values"])
            lines.append(f"No {_NOUN[attr]} given for {e}" + (f" ({other}, not asked)." if other else "."))
        else:
            lines.append(f"{_NOUN[attr]} is stated: {ans}.")
        lines.append(f"so {ans}")
        return "\n".join(lines)

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """One answer turn."""
        return [assistant(task.metadata["answers"][0], self.reasoning(task, effort))]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied context, success claim, the fact sentence, hallucination / refusal, distractor."""
        m = task.metadata
        ans, attr = m["answers"][0], m["attribute"]
        out: dict[str, list[dict[str, Any]]] = {
            "empty": [assistant("")],
            "copied_prompt": [assistant(prompt_text(task))],
            "claims_success": [assistant(_CLAIM)],
            "hedged": [assistant(f"{ans} or {NOT_STATED}" if ans != NOT_STATED else f"{NOT_STATED}, maybe {_fact_value(random.Random(task.id), attr)}")],
        }
        if ans == NOT_STATED:
            rng = random.Random(task.id)
            guess = _fact_value(rng, attr)
            out["hallucinated"] = [assistant(guess)]
        else:
            out["wrongly_not_stated"] = [assistant(NOT_STATED)]
            out["whole_sentence"] = [assistant(_fact_sentence(m["entity"], attr, ans))]
        for o, v in m["other_values"].items():
            if normalize_answer(v) not in {normalize_answer(a) for a in m["answers"]}:
                out[f"distractor_{o}"] = [assistant(v)]
        return out


@register_verifier("general.faithfulness")
def verify_faithfulness(task: Task, final: FinalState) -> Verdict:
    """1.0 iff the normalised response equals a normalised accepted answer."""
    got = normalize_answer(submission_text(final.submission))
    accepted = {normalize_answer(a) for a in task.metadata["answers"]}
    ok = bool(got) and got in accepted
    return Verdict(float(ok), {"exact": float(ok)}, f"expected one of {sorted(accepted)}, got {got[:80]!r}")


# =========================================================================== writing

_PRODUCTS: dict[str, dict[str, list[str]]] = {
    "Kettle": {"category": ["electric kettle"], "feature": ["auto shut-off", "a keep-warm mode", "a 1.7-litre tank"],
               "tagline": ["built for busy mornings", "that boils in two minutes"], "benefit": ["makes every cup simple", "saves you time each day"]},
    "Lamp": {"category": ["desk lamp"], "feature": ["a dimmable warm light", "a USB charging port", "a flexible arm"],
             "tagline": ["made for late study nights", "that fits any small desk"], "benefit": ["keeps your eyes relaxed", "puts light exactly where you need it"]},
    "Pack": {"category": ["hiking backpack"], "feature": ["a rain cover", "padded shoulder straps", "a hydration sleeve"],
             "tagline": ["ready for long trails", "light enough for day trips"], "benefit": ["keeps your gear dry and close", "makes long walks easier"]},
    "Mug": {"category": ["travel mug"], "feature": ["a leak-proof lid", "double steel walls", "a one-hand button"],
            "tagline": ["for coffee on the move", "that fits every cup holder"], "benefit": ["keeps drinks hot for hours", "stops spills on the go"]},
    "Buds": {"category": ["pair of wireless earbuds"], "feature": ["noise cancelling", "a ten-hour battery", "a pocket charging case"],
             "tagline": ["tuned for clear calls", "small enough to forget you wear them"], "benefit": ["lets you focus anywhere", "keeps music playing all day"]},
    "Chair": {"category": ["office chair"], "feature": ["lumbar support", "breathable mesh", "adjustable armrests"],
              "tagline": ["designed for long workdays", "that suits any home office"], "benefit": ["keeps your back comfortable", "helps you sit well for hours"]},
}
_STOP = {"a", "an", "the", "of", "for", "and", "with", "to", "in", "on", "it", "its", "your", "you", "is", "that"}
_SENT_END = re.compile(r"[.!?](?=\s|$)")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+(?:[-'][a-z0-9]+)*", text.lower())


def writing_format_check(text: str, product: str, feature: str, prompt: str) -> dict[str, float]:
    """The rule-based format components of a blurb (1.0 pass / 0.0 fail each).

    ``two_sentences`` exactly two sentences ending in . ! or ?; ``names_product`` the product name
    appears; ``mentions_feature`` every content word of the feature appears; ``length`` 12..60 words;
    ``original`` at least 30% of its words are not in the prompt and it does not restate the instruction.
    """
    t = text.strip()
    words = _words(t)
    ends = _SENT_END.findall(t)
    parts = [p for p in _SENT_END.split(t) if p.strip()]
    feat = [w for w in _words(feature) if w not in _STOP]
    pwords = set(_words(prompt))
    novel = sum(1 for w in words if w not in pwords) / max(len(words), 1)
    restates = "two-sentence" in t.lower() or "blurb" in t.lower()
    return {
        "two_sentences": float(len(ends) == 2 and len(parts) == 2 and bool(re.search(r"[.!?]$", t))),
        "names_product": float(product.lower() in t.lower()),
        "mentions_feature": float(bool(feat) and all(w in words for w in feat)),
        "length": float(12 <= len(words) <= 60),
        "original": float(bool(words) and novel >= 0.3 and not restates),
    }


class WritingFamily(FamilyBase):
    """``general.writing``: a two-sentence product blurb; non-verifiable (the GRM judges quality)."""

    name = "general.writing"
    domain = "general"
    description = "two-sentence product blurb naming a product and a feature; non-verifiable (GRM), rule-based format gate only"
    verifiable = False
    max_difficulty = 2
    id_prefix = "write"

    def lexicon(self) -> tuple[str, ...]:
        """Product-name syllables (lower-case and capitalised) and the product kinds."""
        return lexicon_words(_SYL, *sorted(_PRODUCTS))

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        kind = rng.choice(sorted(_PRODUCTS))
        spec = _PRODUCTS[kind]
        product = f"{_word(rng, 2)} {kind}"
        category = spec["category"][0]
        feature = rng.choice(spec["feature"])
        art = "an" if category[0] in "aeiou" else "a"
        prompt = f"Write a two-sentence product blurb for the {product}, {art} {category}. Mention {feature}."
        extra = None
        if difficulty >= 2:
            extra = rng.choice(["cheerful", "calm", "confident"])
            prompt += f" Use a {extra} tone."
        meta = {
            "product": product,
            "category": category,
            "feature": feature,
            "tone": extra,
            "tagline": rng.choice(spec["tagline"]),
            "benefit": rng.choice(spec["benefit"]),
        }
        return self._task(task_id, [{"role": "user", "content": prompt}], meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        """A tool-less single-answer environment."""
        self._check_task(task)
        return _answer_env(task)

    def blurb(self, task: Task) -> str:
        """The reference blurb (two sentences: introduction with the name, the feature and its benefit)."""
        m = task.metadata
        art = "an" if m["category"][0] in "aeiou" else "a"
        first = f"Meet the {m['product']}, {art} {m['category']} {m['tagline']}."
        feat = m["feature"]
        feat = feat[0].upper() + feat[1:]
        second = f"{feat} {m['benefit']}" if not feat.lower().startswith(("a ", "an ")) else f"With {m['feature']}, it {m['benefit']}"
        return f"{first} {second}{'!' if m['tone'] == 'cheerful' else '.'}"

    def reasoning(self, task: Task, effort: str, text: str) -> str:
        """Plan of the blurb at ``effort``; ``max`` ends with the real word count of ``text``."""
        m = task.metadata
        if effort == "low":
            return ""
        if effort == "high":
            return f"S1 intro {m['product']}; S2 {m['feature']}."
        tone = f", {m['tone']} tone" if m["tone"] else ""
        return (
            f"Needs: 2 sentences, name {m['product']}, mention {m['feature']}{tone}.\n"
            f"S1: introduce the {m['category']}, {m['tagline']}.\n"
            f"S2: {m['feature']} -> {m['benefit']}.\n"
            f"Check: 2 sentences, {len(_words(text))} words."
        )

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """One answer turn with the blurb."""
        text = self.blurb(task)
        return [assistant(text, self.reasoning(task, effort, text))]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied prompt, success claim, keywords only, one sentence, feature left out."""
        m = task.metadata
        first = self.blurb(task).split(". ")[0] + "."
        return {
            "empty": [assistant("")],
            "copied_prompt": [assistant(prompt_text(task))],
            "claims_success": [assistant(_CLAIM)],
            "keywords_only": [assistant(f"{m['product']}. {m['feature']}.")],
            "one_sentence": [assistant(first)],
            "feature_left_out": [assistant(f"{first} It is a great choice for everyone who wants quality.")],
        }


@register_verifier("general.writing")
def verify_writing(task: Task, final: FinalState) -> Verdict:
    """Format gate only (see `writing_format_check`); the quality reward must come from the GRM."""
    m = task.metadata
    text = submission_text(final.submission)
    comps = writing_format_check(text, m["product"], m["feature"], prompt_text(task))
    ok = all(v == 1.0 for v in comps.values())
    failed = [k for k, v in comps.items() if v != 1.0]
    diag = (
        "non-verifiable task: this is a rule-based format check only; the quality reward must come from the GRM "
        f"(SPEC §3.4). format {'ok' if ok else 'failed: ' + ', '.join(failed)}"
    )
    return Verdict(float(ok), {**comps, "format": float(ok)}, diag)


ARITHMETIC = register_family(ArithmeticFamily())
FAITHFULNESS = register_family(FaithfulnessFamily())
WRITING = register_family(WritingFamily())
