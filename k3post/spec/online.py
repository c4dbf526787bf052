"""A draft that follows the policy: the EAGLE-3 draft trained online on the policy's own rollouts during RL
(``rl.draft``, issue 35).

Speculative decoding in RL rollouts pays only while the draft predicts the policy; a draft trained once on the
SFT model's episodes loses acceptance as RL moves the policy. With ``rl.draft=<EAGLE-3 export>`` the rollout engine
drafts with it (``engine.draft``) and, after every RL step (the policy's update and weight push), `OnlineDraft.step`
trains it further:

    samples  = the step's trained trajectories (ids, mask = the tokens the policy sampled)
    for s in 1..rl.draft_steps:
        batch = rl's seeded choice of ≤ batch_size of them (a pure function of (seed, RL step, s))
        the draft's gradient step of `k3post.spec.train.DraftGrads` against the *updated* policy (its hidden
        states recomputed by the trainer's model, QAT as it runs): the LK loss of ``k3post draft``
    the engine's drafter re-reads the weights (`Eagle3Drafter.refresh_weights`): the "push"

The embedded engine's drafter holds the very `Eagle3Draft` module trained here, so the push is a re-read of the
derived weights, as the policy's is a version bump. The draft's embedding is the policy's (shared, never trained
here: it is frozen for the draft's step only). The draft's weights and optimizer state go into the RL checkpoint
(``state_dict``), so a killed run resumes exactly; the final draft is exported next to the RL run
(``<out>/draft``, a folder ``engine.draft`` and vLLM / SGLang load).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from k3post.config.draft import DraftConfig
from k3post.config.optim import OptimConfig
from k3post.spec.data import DraftSample
from k3post.spec.eagle3 import Eagle3Draft
from k3post.spec.train import DraftGrads, draft_batch
from k3post.trainer import build_trainer

__all__ = ["OnlineDraft"]


@contextmanager
def _frozen(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s parameters without gradients inside the block (their flags restored after)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


class OnlineDraft:
    """Trains ``drafter.draft`` (an `Eagle3Drafter`'s) against ``target`` (the policy being trained) after every RL
    step (module doc). ``cfg``: the draft settings (loss, unrolled steps, batch size, max_len, lr, clipping);
    ``steps``: optimizer steps per RL step (0: the draft stays as loaded, for comparison); ``seed``: the batch
    choice."""

    def __init__(self, drafter: Any, target: torch.nn.Module, cfg: DraftConfig, *, steps: int, pad_id: int,
                 seed: int = 0) -> None:
        draft = getattr(drafter, "draft", None)
        if not isinstance(draft, Eagle3Draft):
            raise ValueError(f"rl.draft trains an EAGLE-3 draft online; the engine's drafter is "
                             f"{type(drafter).__name__}: give an EAGLE-3 export of k3post draft")
        self.drafter, self.draft, self.target, self.cfg = drafter, draft, target, cfg
        self.steps, self.pad_id, self.seed = int(steps), int(pad_id), int(seed)
        self.rl_step = 0
        with _frozen(draft.embed_tokens):  # the policy's embedding: not the draft's to train
            self.trainer = build_trainer(draft, OptimConfig(lr=cfg.lr, betas=[0.9, 0.999], eps=1e-8,
                                                            weight_decay=cfg.weight_decay),
                                         device=next(draft.parameters()).device, pad_id=pad_id, grad_clip=cfg.grad_clip)

    def step(self, samples: Sequence[DraftSample]) -> dict[str, float]:
        """``self.steps`` draft steps on ``samples`` (the RL step's trajectories), then the engine's drafter re-reads
        the weights. Returns the mean loss and α per unrolled step over them (empty with no step or no sample)."""
        self.rl_step += 1
        samples = [s for s in samples if any(s.mask)]
        if not self.steps or not samples:
            return {}
        grads = DraftGrads(self.target, self.cfg, self.pad_id)
        rows: list[dict[str, float]] = []
        was_training = self.target.training
        self.target.eval()
        try:
            with _frozen(self.draft.embed_tokens), _frozen(self.target):
                for s in range(self.steps):
                    rng = random.Random(self.seed * 1_000_003 + self.rl_step * 1_009 + s)
                    batch = rng.sample(list(samples), min(self.cfg.batch_size, len(samples)))
                    rows.append(self.trainer.step([draft_batch(batch, self.cfg.max_len, self.pad_id)], grads))
        finally:
            self.target.train(was_training)
            self.draft.eval()
        self.drafter.refresh_weights()
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k == "loss" or k.startswith("alpha_")}

    def state_dict(self) -> dict[str, Any]:
        """The draft's own weights (not the shared embedding), the optimizer, the RL step count."""
        own = {n: t.detach().clone() for n, t in self.draft.state_dict().items() if not n.startswith("embed_tokens.")}
        return {"draft": own, "trainer": self.trainer.state_dict(), "rl_step": self.rl_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.draft.state_dict() if not n.startswith("embed_tokens.") and n not in state["draft"]]
        if missing:
            raise ValueError(f"the checkpoint's online draft lacks {missing[:3]}: not this run's draft")
        with torch.no_grad():
            self.draft.load_state_dict(state["draft"], strict=False)
        self.trainer.load_state_dict(state["trainer"])
        self.rl_step = int(state["rl_step"])
        self.drafter.refresh_weights()
