"""A synthesized sample, below the synthesis loop: the families it may come from (`find_family`, `builtin_families`),
its token counts, stable id and SFT-file form, and its replay in a fresh environment (`replay_sample`: how an edited
sample is re-verified). `k3post.synth.pipeline` (the loop), `k3post.synth.verify` (the funnel's stages) and
`k3post.synth.review` (the review queue) all build on it; it imports none of them. The sample's keys: the
`k3post.synth.pipeline` module docstring.

Shape legend: none.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k3post.envs.env import count_tokens
from k3post.envs.episode import run_episode_sync
from k3post.envs.task import Task

__all__ = ["SFT_KEYS", "builtin_families", "count_sample_tokens", "find_family", "replay_sample", "resolve_families",
           "sample_id", "sft_record"]

log = logging.getLogger("k3post.synth")

SFT_KEYS = ("id", "messages", "tools", "effort", "family", "domain", "teacher", "seed", "difficulty", "task_id", "tokens")


# --------------------------------------------------------------------------- families


def _registry() -> Any:
    from k3post.envs.families import registry

    return registry


def find_family(name: str) -> Any:
    """The registered family ``name``.

    Works while some built-in family modules cannot be imported: on ImportError from the full registry load it
    loads the modules that do import (`registry.load_builtin` with ``skip_broken``). Raises ValueError for an
    unknown name.
    """
    reg = _registry()
    try:
        return reg.get_family(name)
    except ImportError:
        notes = reg.load_builtin(skip_broken=True)
        fams = reg._FAMILIES
        if name not in fams:
            raise ValueError(f"unknown task family {name!r}; available: {sorted(fams)} ({'; '.join(notes)})") from None
        return fams[name]


def builtin_families(domain: str | None = None) -> list[Any]:
    """The built-in families (of ``domain``) synthesis uses by default, sorted by name: ``default_families``, i.e.
    without the opt-in kinds (`OPT_IN_KINDS`; AET reference episodes are near-duplicates of each other by design, the same
    program over other data; name them to synthesise them). Family modules that fail to import are skipped with
    a warning."""
    reg = _registry()
    try:
        return list(reg.default_families(domain))
    except ImportError as e:
        log.warning("not every built-in family module imports (%s); using those that do", e)
    for note in reg.load_builtin(skip_broken=True):
        log.warning("skipping families: %s", note)
    return [f for n, f in sorted(reg._FAMILIES.items())
            if (domain is None or f.domain == domain) and getattr(f, "kind", "") not in reg.OPT_IN_KINDS]


def resolve_families(families: Sequence[Any] | None) -> list[Any]:
    if not families:
        out = builtin_families()
        if not out:
            raise ValueError("no built-in task family could be loaded")
        return out
    return [find_family(f) if isinstance(f, str) else f for f in families]


# --------------------------------------------------------------------------- samples


def count_sample_tokens(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, effort: str | None, xtml: Any = None
) -> dict[str, Any]:
    """Token counts of a trajectory: ``reasoning``, ``output``, ``total`` and the ``method`` (see the module docstring)."""
    asst = [m for m in messages if m.get("role") == "assistant"]
    if xtml is not None:
        from k3post.tokenizer import encode_text

        try:
            r = xtml.render(messages, tools=tools or None, effort=effort)
        except ValueError:
            r = None
        if r is not None:
            reasoning = sum(len(encode_text(xtml.tokenizer, m.get("reasoning_content") or "")) for m in asst)
            return {"reasoning": reasoning, "output": int(sum(r.loss_mask)), "total": len(r.ids), "method": "xtml"}
    reasoning = sum(len((m.get("reasoning_content") or "").split()) for m in asst)
    output = sum(count_tokens(m) for m in asst)
    rest = sum(len(m["content"].split()) for m in messages if m.get("role") != "assistant" and isinstance(m.get("content"), str))
    return {"reasoning": reasoning, "output": output, "total": output + rest, "method": "words"}


def sample_id(teacher: str, family: str, task_id: str, effort: str, seed: int, difficulty: int) -> str:
    """A short stable id: ``s-`` + 12 hex digits of SHA-256 over the provenance."""
    h = hashlib.sha256(f"{teacher}|{family}|{task_id}|{effort}|{seed}|{difficulty}".encode()).hexdigest()
    return f"s-{h[:12]}"


def sft_record(sample: Mapping[str, Any]) -> dict[str, Any]:
    """The SFT-file form of a sample: SFT keys + flat provenance (+ ``reward``); drops task internals."""
    rec = {k: copy.deepcopy(sample.get(k)) for k in SFT_KEYS}
    verdict = sample.get("verdict") or {}
    rec["reward"] = verdict.get("reward")
    return rec


def _scripted_replay(turns: Sequence[Mapping[str, Any]]) -> Callable[[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Any]]:
    script = [json.loads(json.dumps(t)) for t in turns]

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        return copy.deepcopy(script[k]) if k < len(script) else {"role": "assistant", "content": ""}

    return policy


def replay_sample(sample: Mapping[str, Any], family: Any) -> Any:
    """Re-run the sample's assistant turns, in order, in a fresh environment of its task; returns the `Episode`.

    The verdict of the replay is the environment's on the state those turns produce, whatever
    the sample says; an edited sample is re-verified this way.
    """
    try:
        task = Task.from_dict(sample["task"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"sample {sample.get('id')!r}: no task to replay ({e})") from e
    turns = [m for m in sample.get("messages") or [] if m.get("role") == "assistant"]
    if not turns:
        raise ValueError(f"sample {sample.get('id')!r}: no assistant turn to replay")
    return run_episode_sync(_scripted_replay(turns), family.make_env(task), task)
