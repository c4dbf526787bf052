"""Shared pieces of the built-in general and agents families.

* `FamilyBase`     - the `TaskFamily` plumbing: argument checks, a seeded and de-duplicated
                     `generate`, effort checks, scripted reference / wrong policies.
* `scripted_policy` - a policy that replays a fixed list of assistant turns; the turn it plays is
                     the number of assistant messages already in the transcript, so it is
                     stateless and survives pause / resume.
* answer helpers   - `normalize_answer`, `submission_text`, message / tool-call builders.

Reference policies script complete trajectories from the task (the generator knows the
solution) but every fact their reasoning quotes is one the environment shows the model
during the episode, so the traces are faithful. Token counts are never written into the
messages: `k3post.envs.env.count_tokens` counts what is actually there.

Scripted policies assume the identity harness (canonical tool names, full transcript).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from typing import Any

from k3post.constants import EFFORTS, Policy
from k3post.envs.env import Environment
from k3post.envs.task import DOMAINS, FinalState, Task, Verdict, canonical_json

__all__ = [
    "EFFORTS",
    "REFERENCE_VERSION",
    "FamilyBase",
    "Policy",
    "assistant",
    "check_effort",
    "normalize_answer",
    "prompt_text",
    "scripted_policy",
    "submission_text",
    "tool_call",
]



_ARTICLES = ("the ", "a ", "an ")
_PUNCT = string.punctuation.replace("-", "").replace("'", "")


REFERENCE_VERSION = 2
"""Version of the built-in families' reference solutions (what SFT imitates and the demo's tokenizer is trained on):
bump it when they change, so a cached base whose tokenizer was trained on older references is not reused
(`k3post.stages.pretrain.base_key`). 2: issue 31, max-effort references think well beyond the no-thinking floor."""


def check_effort(effort: str) -> str:
    """``effort`` if it is one of `EFFORTS`, else ValueError."""
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
    return effort


def normalize_answer(text: Any) -> str:
    """Lower-case, drop commas inside numbers and surrounding punctuation, collapse spaces, drop a leading article.

    ``"  The Vel River. "`` → ``"vel river"``; ``"12,400"`` → ``"12400"``; a non-string → ``""``.
    """
    if not isinstance(text, str):
        return ""
    s = re.sub(r"(?<=\d),(?=\d)", "", text.strip().lower())
    s = s.translate(str.maketrans({c: " " for c in _PUNCT}))
    s = " ".join(s.split()).strip(" -'")
    for art in _ARTICLES:
        if s.startswith(art):
            s = s[len(art) :]
            break
    return s


def submission_text(submission: Any, key: str = "answer") -> str:
    """The answer text of a submission: a plain-text final answer, or ``submission[key]`` of a submit call."""
    if isinstance(submission, str):
        return submission
    if isinstance(submission, dict):
        v = submission.get(key)
        return v if isinstance(v, str) else ""
    return ""


def prompt_text(task: Task) -> str:
    """All system / user text of the task prompt, joined by blank lines (what a copying policy echoes)."""
    return "\n\n".join(
        m["content"] for m in task.messages if m.get("role") in ("system", "user") and isinstance(m.get("content"), str)
    )


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI tool call (arguments as a JSON string)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def lexicon_words(syllables: Sequence[str], *words: str) -> tuple[str, ...]:
    """A family's `FamilyBase.lexicon`: the name syllables as they appear inside a name (lower-case) and at its
    start (capitalised), then ``words``, each once in that order."""
    return tuple(dict.fromkeys([*syllables, *(x.capitalize() for x in syllables), *words]))


def assistant(content: str = "", reasoning: str = "", calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """An assistant message with ``reasoning_content`` (the think channel), ``content`` and optional calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def scripted_policy(turns: Sequence[dict[str, Any]]) -> Policy:
    """A policy replaying ``turns``: turn k is played when the transcript holds k assistant messages.

    After the script runs out it answers with an empty final message (which ends a tool episode).
    """
    script = [dict(t) for t in turns]
    if not script:
        raise ValueError("a scripted policy needs at least one turn")

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        turn = script[k] if k < len(script) else assistant("")
        return json.loads(json.dumps(turn))

    return policy


class FamilyBase:
    """Plumbing shared by the built-in families; subclasses set the class attributes and implement
    `_make`, `make_env`, `reference_turns` and `wrong_turns`.

    Attributes:
        name: ``"<domain>.<family>"``; also the verifier name.
        domain: one of `DOMAINS`.
        description: one line for ``k3post tasks list``.
        verifiable: False when the reward comes from a judge (the GRM).
        max_difficulty: difficulties are 1..max_difficulty.
        id_prefix: prefix of task ids.
    """

    name: str = ""
    domain: str = ""
    description: str = ""
    verifiable: bool = True
    max_difficulty: int = 3
    id_prefix: str = "task"

    def lexicon(self) -> tuple[str, ...]:
        """Words (names, name parts, titles) the family's tasks are made of, for the tokenizer's lexicon
        (`k3post.tokenizer.lexicon_corpus`); none by default."""
        return ()

    def grm_candidate(self, task: Task, final: FinalState) -> tuple[Verdict, tuple[str, dict[str, str]] | None] | None:
        """The GRM hook: (the rule verdict of ``final``, (the text a judge scores, its artifacts by name) or None
        when the rule gate failed) for a family whose reward is its rule gate times a judged quality
        (`k3post.rewards.grm.gated.judged_reward`, with the judge backend passed in there); None (the default): the
        family's own verifier is its whole reward."""
        return None

    # ------------------------------------------------------------------ to implement

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        """One task drawn from ``rng`` (None to reject the draw and try again)."""
        raise NotImplementedError

    def make_env(self, task: Task) -> Environment:
        """A fresh environment for one episode of ``task``."""
        raise NotImplementedError

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """The reference solver's assistant turns at ``effort``."""
        raise NotImplementedError

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Named scripts of wrong or hacky behaviour; each must score 0."""
        raise NotImplementedError

    # ------------------------------------------------------------------ TaskFamily API

    def generate(self, n: int, *, seed: int, difficulty: int = 1) -> list[Task]:
        """``n`` distinct tasks, a pure function of (``seed``, ``difficulty``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.name}: n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{self.name}: seed must be an int, got {seed!r}")
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= self.max_difficulty:
            raise ValueError(f"{self.name}: difficulty must be an int in 1..{self.max_difficulty}, got {difficulty!r}")
        rng = random.Random(f"{self.name}|{seed}|{difficulty}")
        out: list[Task] = []
        seen: set[str] = set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 50 * n + 200:
                raise ValueError(f"{self.name}: could not draw {n} distinct tasks at difficulty {difficulty} (got {len(out)})")
            task = self._make(rng, difficulty, f"{self.id_prefix}-{seed}-d{difficulty}-{len(out):05d}")
            if task is None:
                continue
            key = canonical_json([list(task.messages), dict(task.metadata)])
            if key in seen:
                continue
            seen.add(key)
            out.append(task)
        return out

    def _check_task(self, task: Task) -> None:
        if not isinstance(task, Task):
            raise ValueError(f"{self.name}: expected a Task, got {type(task).__name__}")
        if task.family != self.name:
            raise ValueError(f"{self.name}: task {task.id!r} belongs to family {task.family!r}")

    def reference_policy(self, task: Task, effort: str) -> Policy:
        """The scripted reference solver at ``effort`` (low / high / max)."""
        self._check_task(task)
        return scripted_policy(self.reference_turns(task, check_effort(effort)))

    def wrong_policies(self, task: Task) -> dict[str, Policy]:
        """Named wrong / hacky policies; every one must score 0."""
        self._check_task(task)
        return {name: scripted_policy(turns) for name, turns in self.wrong_turns(task).items()}

    def _task(self, task_id: str, messages: list[dict[str, Any]], metadata: dict[str, Any], tools: Sequence[Any] = ()) -> Task:
        assert self.domain in DOMAINS
        return Task(
            id=task_id,
            domain=self.domain,
            family=self.name,
            messages=tuple(messages),
            verifier=self.name,
            tools=tuple(tools),
            metadata=metadata,
        )
