"""An example task-family plugin (docs/extending.md): ``general.reverse_words``.

"Reverse the order of these words: amber cider slate. Reply with the words only, separated by spaces." The
answer is checked exactly (words in reverse order, case-insensitive, single spaces). One module is the whole
plugin: the family (`FamilyBase` does the plumbing), its verifier and the ``register_family`` call at the end.
Load it with ``K3POST_FAMILIES=reverse_words`` (this folder on the import path) or, from an installed package,
with an entry point in the group ``k3post.families``; gate it with ``k3post tasks check general.reverse_words``.

What the verifier reads is the final state the environment hands it; the expected answer lives in the task's
metadata, which the policy never sees (the prompt holds the words, not their reversal).
"""

from __future__ import annotations

import random
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.common import FamilyBase, assistant, prompt_text, submission_text
from k3post.envs.families.registry import register_family
from k3post.envs.task import FinalState, Task, Verdict, register_verifier

WORDS = ("amber", "barley", "cider", "copper", "glass", "honey", "linen", "salt", "slate", "timber", "wool", "flint")


class ReverseWordsFamily(FamilyBase):
    """``general.reverse_words``: reverse 3 + difficulty words; exact answer."""

    name = "general.reverse_words"
    domain = "general"
    description = "reverse the order of a few words; exact answer (an example plugin, docs/extending.md)"
    verifiable = True
    max_difficulty = 3
    id_prefix = "rev"

    def lexicon(self) -> tuple[str, ...]:
        return WORDS

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        words = rng.sample(WORDS, 3 + difficulty)
        prompt = f"Reverse the order of these words: {' '.join(words)}. Reply with the words only, separated by spaces."
        return self._task(task_id, [{"role": "user", "content": prompt}], {"words": words, "answer": " ".join(words[::-1])})

    def make_env(self, task: Task) -> ToolEnvironment:
        """No tools: the first plain answer ends the episode and is the submission."""
        self._check_task(task)
        return ToolEnvironment([], end_on_text=True, limits=EpisodeLimits(max_turns=2))

    def reasoning(self, task: Task, effort: str) -> str:
        """max: every word with its new position; high: the reversed list; low: nothing."""
        words = task.metadata["words"]
        if effort == "low":
            return ""
        if effort == "high":
            return "Reversed: " + ", ".join(words[::-1]) + "."
        steps = [f"{i + 1}. {w} (was word {len(words) - i})" for i, w in enumerate(words[::-1])]
        return f"The words are {', '.join(words)}; {len(words)} of them. From the last to the first:\n" + "\n".join(steps)

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        return [assistant(task.metadata["answer"], self.reasoning(task, effort))]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        words = task.metadata["words"]
        return {
            "empty": [assistant("")],
            "copied_prompt": [assistant(prompt_text(task))],
            "original_order": [assistant(" ".join(words))],
            "claims_success": [assistant("Done: the words are reversed.")],
            "answer_in_think_only": [assistant("", task.metadata["answer"])],
            "one_swap_missing": [assistant(" ".join(words[-2::-1] + words[-1:]))],
        }


@register_verifier("general.reverse_words")
def verify_reverse_words(task: Task, final: FinalState) -> Verdict:
    """1.0 iff the response is exactly the reversed words (case and surrounding spaces ignored)."""
    got = " ".join(submission_text(final.submission).lower().split())
    ok = got == task.metadata["answer"]
    return Verdict(float(ok), {"exact": float(ok)}, f"expected {task.metadata['answer']!r}, got {got[:80]!r}")


register_family(ReverseWordsFamily())
