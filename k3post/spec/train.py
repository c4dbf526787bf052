"""Train an EAGLE-3 draft for a frozen target (SPEC §6.2): one readable loop.

    for step in steps:
        batch         = draft samples (the target's own episodes), padded, seeded order (length-bucketed)
        fused, final  = frozen target forward (QAT as the target runs it): [h_low ; h_mid ; h_high], h_final
        p             = target logits = lm_head(norm(h_final))
        q_0 … q_{N-1} = unrolled_logits(draft, fused, ids)          (training-time test, N = cfg.ttt_steps)
        loss          = Σ_i decay^i · draft_loss(p[t+1+i], q_i[t]) over positions whose token t+2+i the target
                        sampled (cfg.loss: LK_α, LK_λ or KL)
        AdamW step on the draft (fc, midlayer, norm, lm_head; the shared embedding stays frozen)

The step is the trainer's (`k3post.trainer.build_trainer`: the device check, gradient clipping, the optimizer)
with the draft's gradient function `DraftGrads` (the loss above over the step's one micro-batch).
Checkpoints (`k3post.checkpoint.save_checkpoint`: ``checkpoints/step-NNNNNN/trainer_state.pt`` holds the draft
weights without the shared embedding, the optimizer, step and RNG) are written atomically and ``latest`` last, so
a killed run resumes exactly. Metrics (stage
``draft``): the loss, α per depth (the expected acceptance rate Σ min(p, q) at temperature 1), the learning rate.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from k3post.checkpoint import latest_checkpoint, load_trainer_state, resuming, save_checkpoint, set_rng_state
from k3post.config.draft import DraftConfig
from k3post.config.optim import OptimConfig
from k3post.metrics import MetricsLogger
from k3post.stages.sft import lr_at
from k3post.spec.data import DraftSample
from k3post.spec.eagle3 import Eagle3Draft, step_weights, target_features, unrolled_step_logits
from k3post.spec.losses import acceptance, draft_loss
from k3post.trainer import build_trainer

__all__ = ["DraftGrads", "DraftResult", "draft_batch", "epoch_batches", "step_batch", "draft_step_losses", "evaluate_alpha", "expected_accept_length", "fit_fc",
           "train_draft"]

STAGE = "draft"


@dataclass
class DraftResult:
    """The trained draft and its history (one row per logged step)."""

    draft: Eagle3Draft
    history: list[dict[str, Any]] = field(default_factory=list)


def draft_batch(samples: Sequence[DraftSample], max_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, sampled_BT, real_BT): samples cut to ``max_len`` and right-padded with ``pad_id``; ``sampled``
    marks tokens the target sampled, ``real`` the non-padding positions."""
    T = min(max_len, max(len(s.ids) for s in samples))
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    sampled = torch.zeros(len(samples), T, dtype=torch.bool)
    real = torch.zeros(len(samples), T, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = min(T, len(s.ids))
        ids[b, :n] = torch.tensor(s.ids[:n])
        sampled[b, :n] = torch.tensor(s.mask[:n])
        real[b, :n] = True
    return ids, sampled, real


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, bucket: int) -> list[list[int]]:
    """The batches (sample indices) of one epoch with length bucketing: a seeded shuffle (a pure function of
    (seed, epoch)), the first ``max(1, n // batch_size)`` batches' worth of it in runs of ``bucket`` batches, each run
    sorted by length and cut into batches, then the batches shuffled. Each sample is in at most one batch of the
    epoch (all of them when ``batch_size`` divides n); with n < ``batch_size`` the one batch is every sample."""
    n = len(lengths)
    rng = random.Random(seed * 1_000_003 + epoch)
    order = rng.sample(range(n), n)
    if n <= batch_size:
        return [order]
    order = order[: (n // batch_size) * batch_size]
    run = bucket * batch_size
    batches = []
    for k in range(0, len(order), run):
        chunk = sorted(order[k:k + run], key=lambda i: (lengths[i], i))
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def step_batch(lengths: Sequence[int], batch_size: int, bucket: int, seed: int, step: int) -> list[int]:
    """The sample indices `train_draft` trains on at ``step``, a pure function of (seed, step) (so a resumed run
    draws the same batches): with ``bucket`` > 1 the step's batch of `epoch_batches`; with 1, ``batch_size``
    consecutive samples (wrapping) of the epoch's seeded shuffle."""
    n = len(lengths)
    per_epoch = max(1, n // batch_size)
    epoch = step // per_epoch
    if bucket > 1:
        return epoch_batches(lengths, batch_size, seed, epoch, bucket)[step % per_epoch]
    order = random.Random(seed * 1_000_003 + epoch).sample(range(n), n)  # one shuffle per epoch
    at = (step * batch_size) % n
    return [order[(at + j) % n] for j in range(min(batch_size, n))]


def _aligned_steps(
    target: torch.nn.Module, draft: Eagle3Draft, ids_BT: torch.Tensor, sampled_BT: torch.Tensor, real_BT: torch.Tensor,
    cfg: DraftConfig, pad_id: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per unrolled step i: (the target's logits at t+1+i [B, n, V], the draft's step-i logits at t [B, n, W],
    mask [B, n]: token t+2+i exists and the target sampled it), n = T − 2 − i."""
    fused, final = target_features(target, ids_BT, draft.config.aux_layer_ids, attention_mask=real_BT.long())
    with torch.no_grad():
        p_BTV = target.lm_head(target.model.norm(final))
    q_N = unrolled_step_logits(draft, fused, ids_BT, steps=cfg.ttt_steps, pad_id=pad_id)
    T = ids_BT.shape[1]
    for i in range(cfg.ttt_steps):
        n = T - 2 - i  # positions t whose predicted token t+2+i exists
        if n <= 0:
            return
        yield p_BTV[:, 1 + i: 1 + i + n], q_N[i][:, :n], sampled_BT[:, 2 + i:] & real_BT[:, 2 + i:]


def _draft_ids(draft: Eagle3Draft, vocab: int) -> torch.Tensor | None:
    """The target id of each draft class when the draft's vocabulary is reduced, else None."""
    return draft.target_ids if draft.lm_head.out_features != vocab else None


def draft_step_losses(
    target: torch.nn.Module, draft: Eagle3Draft, ids_BT: torch.Tensor, sampled_BT: torch.Tensor, real_BT: torch.Tensor,
    cfg: DraftConfig, pad_id: int,
) -> list[Any]:
    """`k3post.spec.losses.DraftLoss` of each unrolled step i (module doc): draft step i at t against the
    target's distribution at t+1+i, where token t+2+i was sampled by the target."""
    return [draft_loss(p, q, mask, kind=cfg.loss, eta=cfg.eta, draft_ids=_draft_ids(draft, p.shape[-1]))
            for p, q, mask in _aligned_steps(target, draft, ids_BT, sampled_BT, real_BT, cfg, pad_id)]


@dataclass(frozen=True)
class DraftGrads:
    """The draft's gradient function (`k3post.trainer.local.Grads`): Σ_i decay^i · the draft loss of unrolled
    step i against the frozen ``target`` (module doc), backward into the draft. One micro-batch per step, an
    ``(ids_BT, sampled_BT, real_BT)`` of `draft_batch`. Returns ``loss`` and ``alpha_<i>`` per unrolled step.

    ``tokens_per_step`` (> 0): the gradient is scaled by the batch's sampled tokens / ``tokens_per_step``, so every
    token weighs the same across steps (each step's loss is a mean over its own tokens). Length-bucketed batches
    (`epoch_batches`) need it: without it a batch of short episodes would weigh as much as one of long ones, and
    the draft trains towards short episodes. ``loss`` is reported unscaled."""

    target: torch.nn.Module
    cfg: DraftConfig
    pad_id: int
    tokens_per_step: float = 0.0

    def __call__(self, draft: torch.nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 *, version: int | None = None, before_backward: Callable[[int], None] | None = None) -> dict[str, float]:
        if len(micro_batches) > 1:
            raise ValueError(f"DraftGrads trains one micro-batch per step, got {len(micro_batches)}")
        out: dict[str, float] = {}
        weights = step_weights(self.cfg.ttt_steps, self.cfg.step_decay)
        for i, batch in enumerate(micro_batches):
            losses = draft_step_losses(self.target, draft, *batch, self.cfg, self.pad_id)  # type: ignore[arg-type]
            loss = sum(float(weights[k]) * dl.loss for k, dl in enumerate(losses))
            scale = float(batch[1].sum()) / self.tokens_per_step if self.tokens_per_step > 0 else 1.0
            if before_backward is not None:
                before_backward(i)
            (loss * scale if scale != 1.0 else loss).backward()
            out = {"loss": float(loss.detach()), **{f"alpha_{k}": dl.alpha for k, dl in enumerate(losses)}}
        return out


@torch.no_grad()
def fit_fc(target: torch.nn.Module, draft: Eagle3Draft, samples: Sequence[DraftSample], cfg: DraftConfig, pad_id: int,
           ridge: float = 1e-4) -> int:
    """Start ``fc`` at the least-squares map from the fused features to the final hidden state (the MTP head's
    input), when the high aux id is not L (stock engines cannot record id L; with id L, [0 0 I] is exact and
    ``fc`` is left as it is). Over the real positions of ``samples`` (X: fused, Y: final, float64):
    W = Yᵀ X (Xᵀ X + ridge · mean(diag Xᵀ X) · I)⁻¹, so step 0 reads the nearest linear estimate of what the head
    was trained on. Returns the positions fitted (0 when left as it is)."""
    ids = draft.config.aux_layer_ids
    if ids[-1] == draft.config.num_target_layers:
        return 0
    G = B = None
    n = 0
    for k in range(0, len(samples), cfg.batch_size):
        ids_BT, _, real_BT = draft_batch(samples[k:k + cfg.batch_size], cfg.max_len, pad_id)
        fused, final = target_features(target, ids_BT, ids, attention_mask=real_BT.long())
        X, Y = fused[real_BT].double(), final[real_BT].double()
        G = X.T @ X if G is None else G + X.T @ X
        B = X.T @ Y if B is None else B + X.T @ Y
        n += X.shape[0]
    if G is None:
        return 0
    eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    W = torch.linalg.solve(G + ridge * G.diagonal().mean() * eye, B).T
    draft.fc.weight.copy_(W.to(draft.fc.weight.dtype))
    return n


@torch.no_grad()
def evaluate_alpha(target: torch.nn.Module, draft: Eagle3Draft, samples: Sequence[DraftSample], cfg: DraftConfig,
                   pad_id: int) -> dict[str, list[float]]:
    """Held-out acceptance per depth over the sampled positions of ``samples``, teacher-forced: ``t1`` the mean
    α = Σ min(p, q) at temperature 1, ``t0`` how often the draft's argmax is the target's (the acceptance rule
    at temperature 0)."""
    sums = {"t1": [0.0] * cfg.ttt_steps, "t0": [0.0] * cfg.ttt_steps}
    counts = [0] * cfg.ttt_steps
    for k in range(0, len(samples), cfg.batch_size):
        batch = draft_batch(samples[k:k + cfg.batch_size], cfg.max_len, pad_id)
        for i, (p, q, mask) in enumerate(_aligned_steps(target, draft, *batch, cfg, pad_id)):
            ids = _draft_ids(draft, p.shape[-1])
            guess = q.argmax(-1) if ids is None else ids.to(q.device)[q.argmax(-1)]
            sums["t1"][i] += float(acceptance(p, q, ids)[mask].sum())
            sums["t0"][i] += float((guess == p.argmax(-1))[mask].sum())
            counts[i] += int(mask.sum())
    return {t: [s / c if c else float("nan") for s, c in zip(v, counts)] for t, v in sums.items()}


def expected_accept_length(alpha_by_depth: Sequence[float], k: int) -> float:
    """Tokens per target forward when drafting ``k`` tokens in a chain, from per-depth acceptance α_i (taken
    as the chance that depth i is accepted given the ones before it): 1 + α_0 + α_0 α_1 + … (k terms after
    the 1, which counts the corrected or bonus token every verify step emits)."""
    if k > len(alpha_by_depth):
        raise ValueError(f"k = {k} needs acceptance at {k} depths, have {len(alpha_by_depth)}")
    total, run = 1.0, 1.0
    for a in alpha_by_depth[:k]:
        run *= a
        total += run
    return total


def train_draft(
    target: torch.nn.Module,
    draft: Eagle3Draft,
    samples: Sequence[DraftSample],
    cfg: DraftConfig,
    out_dir: str | Path,
    *,
    pad_id: int,
    seed: int = 0,
    resume: bool = True,
    metrics: MetricsLogger | None = None,
    stage: str = STAGE,
) -> DraftResult:
    """Train ``draft`` in place against the frozen ``target`` on ``samples`` (module doc); resume from the
    newest checkpoint under ``out_dir/checkpoints`` when there is one."""
    if not samples:
        raise ValueError("no draft samples to train on")
    target.eval()
    for p in [*target.parameters(), *draft.embed_tokens.parameters()]:  # the embedding is the target's: frozen
        p.requires_grad_(False)
    out = Path(out_dir)
    ckpts = out / "checkpoints"
    # the draft's own parameters train (the target's shared embedding is frozen); AdamW at torch's defaults
    trainer = build_trainer(draft, OptimConfig(lr=cfg.lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=cfg.weight_decay),
                            device=next(draft.parameters()).device, pad_id=pad_id, grad_clip=cfg.grad_clip)
    start = 0
    latest = latest_checkpoint(ckpts, keep_last=cfg.keep_last) if resume else None
    if latest is not None:
        with resuming(latest):
            state = load_trainer_state(latest)
            draft.load_state_dict(state["draft"], strict=False)
            trainer.load_state_dict(state)
        set_rng_state(state["rng"])
        start = int(state["step"])
        if metrics is not None:
            metrics.truncate(stage, start)
    else:
        torch.manual_seed(seed)
    # bucketed batches: weigh each step by its sampled tokens against the mean batch's (DraftGrads)
    sampled_per_sample = [sum(s.mask[: cfg.max_len]) for s in samples]
    per_step = min(cfg.batch_size, len(samples)) * sum(sampled_per_sample) / len(samples)
    grads = DraftGrads(target, cfg, pad_id, tokens_per_step=per_step if cfg.length_bucket > 1 else 0.0)
    result = DraftResult(draft)
    bar = tqdm(total=cfg.steps, initial=start, desc=stage, disable=not cfg.progress, dynamic_ncols=True, mininterval=1.0)
    lengths = [min(len(s.ids), cfg.max_len) for s in samples]
    for step in range(start, cfg.steps):
        batch = [samples[i] for i in step_batch(lengths, cfg.batch_size, cfg.length_bucket, seed, step)]
        lr = lr_at(step, cfg)
        m = trainer.step([draft_batch(batch, cfg.max_len, pad_id)], grads, lr=lr)
        row = {"loss": m["loss"], "lr": lr, **{k: v for k, v in m.items() if k.startswith("alpha_")}}
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", alpha_0=f"{row.get('alpha_0', float('nan')):.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            result.history.append({"step": step + 1, **row})
            if metrics is not None:
                metrics.log(stage, step + 1, row)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            own = {n: t for n, t in draft.state_dict().items() if not n.startswith("embed_tokens.")}  # not the target's
            save_checkpoint(ckpts, step + 1, None, None, {**trainer.state_dict(), "draft": own}, keep_last=cfg.keep_last)
    bar.close()
    draft.eval()
    return result
