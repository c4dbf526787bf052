"""Built-in arithmetic family: multi-digit addition with an exactly checkable answer.

Generator (seeded, difficulty = number of digits), reference solver at every effort level and a
verifier that reads only the final answer in the `response` channel.

Reference traces by effort (the reasoning goes into the `think` channel):
    max   one line per column, least significant first, naming digit and carry, then the answer:
          "7+9=16 d6 c1\n4+8+1=13 d3 c1\n3+5+1=9 d9 c0\nso 936"
    high  the column sums only: "7+9=16\n4+8+1=13\n3+5+1=9"
    low   no reasoning (empty think channel): the answer directly

At this scale effort changes accuracy (../shared/CALIBRATION.md: with a column trace the tiny MoE reaches
100% held-out accuracy, answering directly it stays at 0%), which is the trade-off effort control learns.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

EFFORTS = ("low", "high", "max")


@dataclass(frozen=True)
class AdditionTask:
    """a + b with a known answer."""

    a: int
    b: int

    @property
    def id(self) -> str:
        return f"add-{self.a}-{self.b}"

    @property
    def answer(self) -> int:
        return self.a + self.b

    def prompt(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"What is {self.a}+{self.b}?"}]


def generate(n: int, *, seed: int, min_digits: int = 2, max_digits: int = 3, exclude: set[str] | None = None) -> list[AdditionTask]:
    """`n` distinct tasks with operands of `min_digits`..`max_digits` digits, none of whose ids is in `exclude`."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    lo, hi = 10 ** (min_digits - 1) if min_digits > 1 else 0, 10**max_digits - 1
    space = (hi - lo + 1) ** 2 - len(exclude or ())
    if n > space:
        raise ValueError(f"asked for {n} distinct addition tasks but only {space} exist with {min_digits}-{max_digits} digits")
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[AdditionTask] = []
    while len(out) < n:
        t = AdditionTask(rng.randint(lo, hi), rng.randint(lo, hi))
        if t.id not in seen:
            seen.add(t.id)
            out.append(t)
    return out


def reasoning(task: AdditionTask, effort: str) -> str:
    """The reference reasoning trace for `effort` (see module docstring)."""
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort '{effort}'; expected one of {EFFORTS}")
    if effort == "low":
        return ""
    da, db = str(task.a)[::-1], str(task.b)[::-1]
    carry, lines = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        lines.append(f"{terms}={s} d{s % 10} c{s // 10}" if effort == "max" else f"{terms}={s}")
        carry = s // 10
    if effort == "max":
        lines.append(f"so {task.answer}")
    return "\n".join(lines)


def reference_messages(task: AdditionTask, effort: str) -> list[dict[str, Any]]:
    """Prompt + the reference assistant turn at `effort`."""
    return task.prompt() + [
        {"role": "assistant", "reasoning_content": reasoning(task, effort), "content": str(task.answer)}
    ]


_INT = re.compile(r"^\s*(-?\d+)\s*$")


def verify(task: AdditionTask, assistant: dict[str, Any]) -> float:
    """1.0 iff the response channel holds exactly the right integer (reasoning is never read)."""
    m = _INT.match(assistant.get("content") or "")
    return 1.0 if m is not None and int(m.group(1)) == task.answer else 0.0


def sft_records(tasks: list[AdditionTask], efforts: list[str] | tuple[str, ...], *, seed: int) -> list[dict[str, Any]]:
    """SFT JSONL records (`messages`, `tools`, `effort`), efforts assigned round-robin in a seeded order."""
    rng = random.Random(seed)
    recs = []
    for i, t in enumerate(tasks):
        effort = efforts[i % len(efforts)]
        recs.append({"id": t.id, "messages": reference_messages(t, effort), "tools": None, "effort": effort})
    rng.shuffle(recs)
    return recs
