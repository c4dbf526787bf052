"""Held-out evaluation: greedy completions at each effort level, parsed from XTML and verified.

Generation here is plain ``transformers`` ``generate`` (left-padded batches, greedy, stop on
``<|end_of_msg|>``); the rollout engine replaces it for RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3post.xtml import XTML


@dataclass
class EvalConfig:
    """Held-out evaluation settings."""

    efforts: list[str] = field(default_factory=lambda: ["max", "high", "low"])
    max_new_tokens: int = 96
    batch_size: int = 100
    n_examples: int = 3  # completions kept per effort for the report


@torch.no_grad()
def greedy_complete(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_id: int,
    pad_id: int,
    batch_size: int = 64,
    progress: bool = False,
) -> list[list[int]]:
    """Greedy completions (without the prompt), each cut after its first `stop_id`."""
    was_training = model.training
    model.eval()
    outs: list[list[int]] = []
    for k in tqdm(range(0, len(prompts), batch_size), desc="generate", disable=not progress, leave=False):
        chunk = prompts[k : k + batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        att = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, L - len(p) :] = torch.tensor(list(p))
            att[i, L - len(p) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=att,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_id,
            pad_token_id=pad_id,
        )
        for row in gen[:, L:].tolist():
            cut = row.index(stop_id) + 1 if stop_id in row else len(row)
            outs.append(row[:cut])
    if was_training:
        model.train()
    return outs


def evaluate_family(
    model: torch.nn.Module,
    xtml: XTML,
    family: Any,
    tasks: Sequence[Any],
    *,
    effort: str | None,
    cfg: EvalConfig,
) -> dict[str, Any]:
    """Pass rate, token counts and examples of greedy completions on single-turn `tasks` at one effort.

    Each completion is parsed from XTML and handed to a fresh environment of the task's family, whose
    verifier scores the final state (the same path as any episode). Multi-turn agentic families need the
    rollout engine's agent loop and are evaluated there.
    """
    from k3post.envs.episode import run_episode_sync

    prompts = [
        xtml.render(list(t.messages), tools=[dict(x) for x in t.tools] or None, effort=effort, add_generation_prompt=True).ids
        for t in tasks
    ]
    completions = greedy_complete(
        model, prompts, max_new_tokens=cfg.max_new_tokens, stop_id=xtml.eom_id, pad_id=xtml.pad_id, batch_size=cfg.batch_size
    )
    rewards, think_tokens, out_tokens, malformed, examples = [], [], [], 0, []
    for t, ids in zip(tasks, completions):
        try:
            msg = xtml.parse(ids)
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
    return {
        "family": family.name,
        "effort": effort,
        "n": len(tasks),
        "pass_rate": sum(rewards) / n,
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


def sequence_logprobs(model: torch.nn.Module, ids_BT: torch.Tensor, attn_BT: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t ≥ 1, from one full forward: [B, T-1] (float32)."""
    logits = model(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)


def train_inference_logprob_gap(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, pad_id: int
) -> dict[str, float]:
    """Max |Δ log p| over the tokens of `sequences` between the training forward (train mode, autograd on)
    and the inference forward (eval mode, inference_mode). With QAT both use the same MX quantizer, so on
    CPU the gap is exactly 0.
    """
    L = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s))
        att[i, : len(s)] = 1
    valid = att[:, 1:].bool()
    was_training = model.training
    model.train()
    train_lp = sequence_logprobs(model, ids, att).detach()
    model.eval()
    with torch.inference_mode():
        infer_lp = sequence_logprobs(model, ids, att)
    model.train(was_training)
    diff = (train_lp - infer_lp).abs()[valid]
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "tokens": int(valid.sum())}
