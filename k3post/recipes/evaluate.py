"""Held-out evaluation: completions at each effort level, parsed from XTML and verified.

Generation goes through the rollout engine (`k3post.rollout.EmbeddedEngine`): every prompt is one
request, continuously batched (a slot freed by a finished completion is refilled in the next
step, no padding), stopping on ``<|end_of_msg|>``. Greedy (temperature 0) is the default; a
temperature > 0 gives one sample per prompt (pass@1 at that temperature), prompt i seeded
``request_seed(seed, str(i))`` so its tokens depend only on (seed, i, prompt, weights), never on
batching. A QAT model (``k3post.quant.qat.apply_qat``) is evaluated with its MX fake-quant
forward, as the engine runs the patched experts. The RL loop passes the engine it already holds.

Shape legend: none (token lists only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from tqdm.auto import tqdm

from k3post.config.eval import EvalConfig
from k3post.config.rollout import EngineConfig
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.factory import build_engine, close_engine
from k3post.rollout.engine import GenerationRequest, SamplingParams, request_seed
from k3post.stats import wilson_interval

if TYPE_CHECKING:
    from k3post.xtml import XTML


def _engine_for(model: torch.nn.Module, engine: EmbeddedEngine | None, batch_size: int,
                engine_cfg: EngineConfig | None = None, tokenizer: Any = None) -> EmbeddedEngine:
    """``engine`` (checked to run ``model`` and to be idle), or a fresh one over ``model`` of ``engine_cfg``
    (default: embedded; ``http`` + ``launch``: local servers of its own, which need ``tokenizer``).

    A fresh engine costs ~10 ms on the tiny model (rotary table, slot KV cache of ``batch_size``
    slots, fused weight copies on first use), so one is built per call instead of cached.
    """
    if engine is None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        return build_engine(model, tokenizer, engine=engine_cfg, role="evaluated model", max_batch_size=batch_size)
    if engine.model is not model:
        raise ValueError("engine runs a different model than the one to evaluate; pass engine.model")
    if engine.has_unfinished():
        raise ValueError("evaluation needs an idle engine (it has queued or running requests)")
    return engine


def complete(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_id: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
    engine: EmbeddedEngine | None = None,
    progress: bool = False,
    engine_cfg: EngineConfig | None = None,
    tokenizer: Any = None,
) -> list[list[int]]:
    """Completions (without the prompt) of ``model``, each ending at its first ``stop_id``
    (kept) or after ``max_new_tokens`` tokens; in prompt order.

    Args:
        temperature: 0 is greedy (argmax); > 0 samples softmax(logits / temperature), prompt i
            with seed ``request_seed(seed, str(i))`` (counter-based, batch-independent).
        batch_size: slots of the engine built here (ignored when ``engine`` is given).
        engine: an idle `EmbeddedEngine` over ``model`` to use instead of building one (its
            paused requests stay; this call's request ids are ``eval-<i>``).
        engine_cfg, tokenizer: the engine built here (`k3post.config.rollout.EngineConfig`; default
            embedded); an ``http`` one with ``launch`` saves ``model`` with ``tokenizer`` for its servers
            and is closed at the end.
    A prompt + completion never exceeds the engine's ``max_model_len`` (config
    ``max_position_embeddings``): a completion reaching it ends there.
    """
    eng = _engine_for(model, engine, batch_size, engine_cfg, tokenizer)
    requests = [
        GenerationRequest(
            f"eval-{i}", list(p),
            SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop_ids=(stop_id,), seed=request_seed(seed, str(i))),
        )
        for i, p in enumerate(prompts)
    ]
    was_training = model.training
    model.eval()  # once here, not per engine step
    live: list[str] = []
    done: dict[str, list[int]] = {}
    try:
        for r in requests:
            eng.add_request(r)
            live.append(r.request_id)
        with tqdm(total=len(requests), desc="generate", disable=not progress, leave=False) as bar:
            while eng.has_unfinished():
                for res in eng.step():
                    done[res.request_id] = res.output_ids
                    bar.update(1)
    except BaseException:  # leave a caller's engine idle: drop what this call still has in it
        eng.abort([rid for rid in live if rid not in done])
        raise
    finally:
        model.train(was_training)
        if eng is not engine:
            close_engine(eng)
    return [done[r.request_id] for r in requests]


def greedy_complete(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_id: int,
    pad_id: int | None = None,
    batch_size: int = 64,
    progress: bool = False,
    engine: EmbeddedEngine | None = None,
) -> list[list[int]]:
    """Greedy completions (without the prompt), each cut after its first ``stop_id``: `complete`
    at temperature 0. ``pad_id`` is not used (the engine never pads); it is accepted so callers
    written for the padded ``generate`` path keep working."""
    return complete(
        model, prompts, max_new_tokens=max_new_tokens, stop_id=stop_id, batch_size=batch_size, engine=engine, progress=progress
    )


def evaluate_family(
    model: torch.nn.Module,
    xtml: XTML,
    family: Any,
    tasks: Sequence[Any],
    *,
    effort: str | None,
    cfg: EvalConfig,
    engine: EmbeddedEngine | None = None,
) -> dict[str, Any]:
    """Pass rate, token counts and examples of completions on single-turn `tasks` at one effort:
    greedy, or one sample per task at ``cfg.temperature`` > 0 (pass@1), through ``engine`` (an
    idle `EmbeddedEngine` over ``model``) or one built with ``cfg.batch_size`` slots.

    Each completion is parsed from XTML and handed to a fresh environment of the task's family, whose
    verifier scores the final state (the same path as any episode). Multi-turn agentic families need the
    rollout engine's agent loop and are evaluated there.
    """
    from k3post.envs.episode import run_episode_sync

    prompts = [
        xtml.render(list(t.messages), tools=[dict(x) for x in t.tools] or None, effort=effort, add_generation_prompt=True).ids
        for t in tasks
    ]
    completions = complete(
        model, prompts, max_new_tokens=cfg.max_new_tokens, stop_id=xtml.eom_id, temperature=cfg.temperature, seed=cfg.seed,
        batch_size=cfg.batch_size, engine=engine, engine_cfg=cfg.engine, tokenizer=xtml.tokenizer,
    )
    rewards, think_tokens, out_tokens, malformed, examples = [], [], [], 0, []
    for t, ids in zip(tasks, completions):
        try:
            msg = xtml.parse(ids, after_prefix=True)
        except ValueError:
            malformed += 1
            r = 0.0
        else:
            episode = run_episode_sync(lambda messages, tools, _m=msg: _m, family.make_env(t), t)
            r = float(episode.reward)
        rewards.append(r)
        out_tokens.append(len(ids))
        think_tokens.append(count_think_tokens(xtml, ids))
        if len(examples) < cfg.n_examples:
            examples.append({"task": t.id, "completion": xtml.tokenizer.decode(ids)[:600], "reward": r})
    n = max(len(tasks), 1)
    passed = [r >= 1.0 for r in rewards]
    return {
        "family": family.name,
        "effort": effort,
        "temperature": cfg.temperature,
        "n": len(tasks),
        "pass_rate": sum(rewards) / n,
        "pass_ci95": list(wilson_interval(sum(passed), len(tasks))),
        "task_ids": [t.id for t in tasks],
        "passed": passed,
        "mean_think_tokens": sum(think_tokens) / n,
        "mean_output_tokens": sum(out_tokens) / n,
        "malformed": malformed,
        "examples": examples,
    }


def count_think_tokens(xtml: XTML, completion: Sequence[int]) -> int:
    """Tokens inside the think channel of a completion that starts inside it (SPEC §3.3 T(y), general tasks)."""
    close = xtml.tokenizer.convert_tokens_to_ids("<|close|>")
    ids = list(completion)
    return ids.index(close) if close in ids else len(ids)

