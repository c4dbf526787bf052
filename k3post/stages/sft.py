"""Stage 1 SFT: next-token cross-entropy over loss-masked XTML tokens (SPEC §2).

The loop, as the algorithm box reads::

    for step in steps:
        for micro-batch in grad_accum packed micro-batches:
            loss += CE(model(packed rows), next tokens where loss_mask) / N_tokens(step)
            [sft.mtp_weight > 0, step >= sft.mtp_start_fraction * sft.steps]
                                  loss += mtp_weight * CE(MTP head, token t+2) / N_mtp_tokens(step)
        clip grads; AdamW step; warmup+cosine LR          `sft_step`: the trainer's step (build_trainer: one
                                                          process, or over distributed.fsdp.ranks: sharded,
                                                          or replicas with strategy=no_shard) with the SFT
                                                          gradient function `SFTGrads`; a step with fewer
                                                          micro-batches than ranks has its rows split over them
        log; checkpoint every `save_every`

The loss is a token mean over the whole optimizer step (all micro-batches), so gradient accumulation gives
the same update as one big batch. QAT (MXFP4 expert weights, MXFP8 expert inputs) is on from the first
step when the run's `qat.enabled` is true. Resume restores weights, AdamW moments, the LR schedule, RNG
states and the data position, so the losses after a resume equal an uninterrupted run's. The MTP head
(`k3post.spec.mtp`, only when `sft.mtp_weight > 0`) trains beside the model, its parameters after the model's
in the one AdamW, and is checkpointed as `mtp.safetensors` in each checkpoint folder. Before
step int(`sft.mtp_start_fraction` x `sft.steps`) the head gets no loss and no gradient (AdamW skips it), so those steps are the plain
SFT steps exactly; starting it late buys an MTP head for a fraction of its cost (the demo: the last 20% of its steps).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from k3post.config.sft import SFTConfig
from k3post.checkpoint import latest_checkpoint, resuming, set_rng_state
from k3post.config.optim import OptimConfig
from k3post.data import PackedBatch, Sample, collate, iter_microbatches
from k3post.metrics import MetricsLogger
from k3post.packed_attention import use_packed_attention
from k3post.spec.mtp import MTPHead, capture_final_hidden, load_mtp, mtp_ce_sum, mtp_labels, save_mtp
from k3post.trainer import build_trainer

log = logging.getLogger("k3post.sft")


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    losses: list[float]
    resumed_from: int | None
    wall_s: float
    tokens_per_s: float
    mtp_losses: list[float] = field(default_factory=list)  # per-step MTP CE (token mean), when sft.mtp_weight > 0
    mtp: MTPHead | None = None  # the trained MTP head (save it with `save_mtp` beside the model)


def lr_at(step: int, cfg: Any) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine down to `lr * min_lr_ratio` at `steps` (``cfg``: any
    config with those four fields, `SFTConfig` or `k3post.config.draft.DraftConfig`)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class _DataStream:
    """Endless packed micro-batches over epochs; its position (epoch, index) is checkpointed."""

    def __init__(self, samples: Sequence[Sample], cfg: SFTConfig, seed: int, epoch: int = 0, index: int = 0) -> None:
        self.samples, self.cfg, self.seed = samples, cfg, seed
        self.epoch, self.index = epoch, index
        self._it = self._epoch_iter()

    def _epoch_iter(self) -> Iterator[list[list[int]]]:
        it = iter_microbatches(
            self.samples, pack_len=min(self.cfg.pack_len, self.cfg.max_len), rows_per_batch=self.cfg.rows_per_batch,
            seed=self.seed, epoch=self.epoch,
        )
        for _ in range(self.index):
            next(it)
        return it

    def next(self) -> list[list[int]]:
        try:
            rows = next(self._it)
        except StopIteration:
            self.epoch, self.index = self.epoch + 1, 0
            self._it = self._epoch_iter()
            rows = next(self._it)
        self.index += 1
        return rows

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


def has_local_attention(config: Any) -> bool:
    """True when some layer of the model attends through a window (sliding / chunked layers in
    ``layer_types``, or a Mistral-style ``sliding_window`` for every layer)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return any(t != "full_attention" for t in layer_types)
    return bool(getattr(cfg, "sliding_window", None))


def packed_attention_mask(model: torch.nn.Module, batch: PackedBatch) -> Any:
    """The ``attention_mask`` argument for packed rows: the block-diagonal causal mask (4-D, which
    transformers applies as is to every layer) for models whose layers all attend fully. A model
    with windowed layers (gpt-oss) gets one mask per layer type, built by transformers' own mask
    functions from the restarting position ids (packed-sequence detection), so sliding layers keep
    their window inside each sample; without ``layer_types`` (Mistral) None, and the model derives
    the packed windowed mask from the position ids itself."""
    cfg = model.config.get_text_config(decoder=True)
    if not has_local_attention(cfg):
        return batch.attention_mask_R1LL
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return None
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    unknown = sorted(set(layer_types) - set(makers))
    if unknown:
        raise ValueError(f"SFT packing has no mask for layer types {unknown} of {type(model).__name__}")
    R, L = batch.input_ids_RL.shape
    probe_RL1 = torch.zeros(R, L, 1, dtype=next(model.parameters()).dtype, device=batch.input_ids_RL.device)
    return {t: makers[t](config=cfg, inputs_embeds=probe_RL1, attention_mask=None, cache=None,
                         position_ids=batch.position_ids_RL) for t in set(layer_types)}


def masked_ce_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Σ over trainable positions of −log p(next token): packed rows, no attention across samples
    (``packed_attention_mask``; for a model whose layers all attend fully and run HF's SDPA, one causal
    attention call per sample instead of the masked rows, `k3post.packed_attention`)."""
    mask = packed_attention_mask(model, batch)
    extra: dict[str, Any] = {}
    if batch.segments is not None and isinstance(mask, torch.Tensor) and use_packed_attention(model):
        extra["packed_segments"] = batch.segments
    out = model(
        input_ids=batch.input_ids_RL,
        position_ids=batch.position_ids_RL,
        attention_mask=mask,
        use_cache=False,
        **extra,
    )
    logits_RLV = out.logits
    return F.cross_entropy(logits_RLV.flatten(0, 1).float(), batch.labels_RL.flatten(), ignore_index=-100, reduction="sum")


def sft_grads(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    *,
    n_tok: int,
    precision: str = "fp32",
    mtp: MTPHead | None = None,
    mtp_weight: float = 0.0,
    n_mtp: int = 0,
    mtp_detach: bool = False,
    before_backward: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """Forward and backward of the SFT loss over ``batches`` (gradients accumulate; not zeroed here):

        loss_b = CE_sum(batch b) / n_tok  [+ mtp_weight · MTP_CE_sum(b) / n_mtp]

    ``n_tok`` / ``n_mtp``: the trained tokens of the whole optimizer step (over every rank, for a sharded
    trainer), so the micro-batches' gradients add up to the token mean. ``precision`` "bf16" runs the forward
    under bf16 autocast. ``before_backward(i)`` runs before the i-th backward. The batches move to the model's
    device. ``mtp_detach``: the MTP term trains the head only (`k3post.spec.mtp.mtp_ce_sum`'s ``detach_target``), so
    the model's gradients are those of the CE term alone. Returns the summed CE and MTP CE (not normalised)."""
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    total, mtp_total = 0.0, 0.0
    for i, b in enumerate(batches):
        b = b.to(device)
        if mtp is None:
            with autocast:
                loss_sum = masked_ce_sum(model, b)
            loss = loss_sum / max(n_tok, 1)
        else:
            with autocast, capture_final_hidden(model) as final:
                loss_sum = masked_ce_sum(model, b)
                mtp_sum = mtp_ce_sum(mtp, model, b.input_ids_RL, b.position_ids_RL, b.labels_RL,
                                     final.hidden_BTD, b.attention_mask_R1LL, detach_target=mtp_detach)
            loss = loss_sum / max(n_tok, 1) + mtp_weight * mtp_sum / max(n_mtp, 1)
            mtp_total += mtp_sum.item()
        if before_backward is not None:
            before_backward(i)
        loss.backward()
        total += loss_sum.item()
    return total, mtp_total


@dataclass(frozen=True)
class SFTGrads:
    """`sft_grads` as a trainer's gradient function (`k3post.trainer.local.Grads`): micro-batches are packed
    batches; ``n_tok`` / ``n_mtp`` the trained tokens of the whole step. Returns the summed CE ``loss`` and MTP
    CE ``mtp_loss``."""

    n_tok: int
    precision: str = "fp32"
    mtp: MTPHead | None = None
    mtp_weight: float = 0.0
    n_mtp: int = 0
    mtp_detach: bool = False

    def __call__(self, model: torch.nn.Module, micro_batches: Sequence[PackedBatch], *, version: int | None = None,
                 before_backward: Callable[[int], None] | None = None) -> dict[str, float]:
        loss, mtp_loss = sft_grads(model, micro_batches, n_tok=self.n_tok, precision=self.precision, mtp=self.mtp,
                                   mtp_weight=self.mtp_weight, n_mtp=self.n_mtp, mtp_detach=self.mtp_detach,
                                   before_backward=before_backward)
        return {"loss": loss, "mtp_loss": mtp_loss}

    def shipped(self) -> "SFTGrads":
        """This function as sent to the other ranks of a replicated trainer: without the MTP head's weights (each
        rank trains its own replica of it, `on_rank`)."""
        return replace(self, mtp=None)

    def on_rank(self, extra: Any) -> "SFTGrads":
        """A shipped function bound to this rank's trainer's extra module (the MTP head) when it trains one."""
        return replace(self, mtp=extra) if self.mtp_weight > 0 and self.mtp is None else self


def sft_step(trainer: Any, batches: Sequence[PackedBatch], *, lr: float | None = None, precision: str = "fp32",
             mtp: MTPHead | None = None, mtp_weight: float = 0.0, mtp_detach: bool = False) -> dict[str, float]:
    """One SFT optimizer step through ``trainer`` (`k3post.trainer.Trainer.step` with `SFTGrads`: the token mean
    over ``batches``) at learning rate ``lr`` (None: unchanged); with ``mtp_weight`` > 0 the MTP head ``mtp``
    (the trainer's ``extra`` module) trains too and its loss is added (``mtp_detach``: the head alone learns from
    it). Returns loss, grad_norm, target_tokens
    (and mtp_loss)."""
    if mtp_weight > 0 and mtp is None:
        raise ValueError("sft_step: mtp_weight > 0 needs the MTP head (the trainer's extra module)")
    mtp = mtp if mtp_weight > 0 else None
    n_tok = sum(b.n_target_tokens for b in batches)
    n_mtp = sum(int((mtp_labels(b.labels_RL, b.position_ids_RL) != -100).sum()) for b in batches) if mtp else 0
    sums = trainer.step(batches, SFTGrads(n_tok, precision, mtp, mtp_weight, n_mtp, mtp_detach), lr=lr)
    out = {"loss": sums["loss"] / max(n_tok, 1), "grad_norm": sums["grad_norm"], "target_tokens": float(n_tok)}
    if mtp is not None:
        out["mtp_loss"] = sums["mtp_loss"] / max(n_mtp, 1)
    return out


def train_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[Sample],
    cfg: SFTConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    metrics: MetricsLogger | None = None,
    stage: str = "sft",
    resume: bool = True,
) -> SFTResult:
    """Train `model` in place on `samples`; checkpoints go to `out_dir/checkpoints`. See module docstring."""
    if cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"sft.precision must be fp32 or bf16, got {cfg.precision!r}")
    if min(cfg.steps, cfg.rows_per_batch, cfg.grad_accum, cfg.pack_len, cfg.max_len) <= 0:
        raise ValueError("sft.steps, sft.rows_per_batch, sft.grad_accum, sft.pack_len and sft.max_len must be positive")
    if cfg.mtp_weight < 0:
        raise ValueError(f"sft.mtp_weight must be >= 0, got {cfg.mtp_weight}")
    if not 0 <= cfg.mtp_start_fraction < 1:
        raise ValueError(f"sft.mtp_start_fraction must be in [0, 1), got {cfg.mtp_start_fraction}")
    mtp_start = int(cfg.mtp_start_fraction * cfg.steps)
    out = Path(out_dir)
    ckpt_root = out / "checkpoints"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    mtp = _new_mtp_head(model, seed) if cfg.mtp_weight > 0 else None
    if not has_local_attention(model.config.get_text_config(decoder=True)):
        use_packed_attention(model)  # before the trainer: its ranks build their models from this config
    home = next(model.parameters()).device  # where the model goes back to after training on cfg.device
    trainer = build_trainer(model, OptimConfig(lr=cfg.lr, betas=list(cfg.betas), eps=1e-8, weight_decay=cfg.weight_decay),
                            device=cfg.device, pad_id=pad_id, grad_clip=cfg.grad_clip, extra=mtp,
                            clip_extra_apart=cfg.mtp_detach, extra_lr_scale=cfg.mtp_lr_scale)
    ranks = getattr(trainer, "world", 1)  # the ranks a data-parallel trainer splits each step's micro-batches over
    start, stream, losses, mtp_losses = 0, _DataStream(samples, cfg, seed), [], []
    window_loss, window_n = 0.0, 0  # token-weighted loss sum and tokens since the last logged row
    resumed_from = None
    ckpt = latest_checkpoint(ckpt_root, keep_last=cfg.keep_last) if resume else None
    if ckpt is not None:
        with resuming(ckpt):
            state = trainer.load_checkpoint(ckpt)
            if mtp is not None:
                _load_mtp_into(mtp, ckpt)
        set_rng_state(state["rng"])
        start = resumed_from = int(state["step"])
        stream = _DataStream(samples, cfg, seed, **state["data"])
        losses = list(state.get("losses", []))
        mtp_losses = list(state.get("mtp_losses", []))
        window_loss, window_n = state.get("log_window", (0.0, 0))  # the logged loss averages since the last log
        if metrics is not None:
            metrics.truncate(stage, start)
        log.info("resumed %s from %s (step %d)", stage, ckpt, start)
    elif resume and metrics is not None:  # a run killed before its first checkpoint may have logged rows
        metrics.truncate(stage, 0)
    model.train()
    bar = tqdm(total=cfg.steps, initial=start, desc=stage, disable=not cfg.progress, dynamic_ncols=True, mininterval=1.0)
    t0, tokens_seen, loss_val = time.perf_counter(), 0, float("nan")
    window_t, window_tok = time.perf_counter(), 0
    for step in range(start, cfg.steps):
        step_rows = [stream.next() for _ in range(cfg.grad_accum)]
        if ranks > len(step_rows):  # a data-parallel trainer: every rank gets a share of the step's rows
            step_rows = [part for rows in step_rows for part in (rows[r::ranks] for r in range(ranks)) if part]
        batches = [collate(samples, rows, cfg.max_len, pad_id) for rows in step_rows]
        n_tok = sum(b.n_target_tokens for b in batches)
        lr = lr_at(step, cfg)
        step_mtp = mtp if step >= mtp_start else None  # before the start: the plain SFT step exactly
        m = sft_step(trainer, batches, lr=lr, precision=cfg.precision, mtp=step_mtp,
                     mtp_weight=cfg.mtp_weight if step_mtp else 0.0, mtp_detach=cfg.mtp_detach)
        loss_val, grad_norm = m["loss"], m["grad_norm"]
        losses.append(loss_val)
        if step_mtp is not None:
            mtp_losses.append(m["mtp_loss"])
        step_tokens = sum(int(b.input_ids_RL.numel()) for b in batches)
        tokens_seen += step_tokens
        window_tok += step_tokens
        window_loss, window_n = window_loss + loss_val * n_tok, window_n + n_tok
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            now = time.perf_counter()
            tps = window_tok / max(now - window_t, 1e-9)
            mean_loss = window_loss / max(window_n, 1)  # token-weighted mean over the steps since the last log
            window_t, window_tok, window_loss, window_n = now, 0, 0.0, 0
            if metrics is not None:
                row = {"loss": mean_loss, "step_loss": loss_val, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "target_tokens": n_tok}
                if step_mtp is not None:
                    row["mtp_loss"] = mtp_losses[-1]
                metrics.log(stage, done, row)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tps:,.0f}")
        bar.update(1)
        if done % cfg.save_every == 0 or done == cfg.steps:
            trainer.save_checkpoint(
                ckpt_root, done, tokenizer=tokenizer,
                state={"data": stream.state(), "losses": losses, "mtp_losses": mtp_losses,
                       "log_window": (window_loss, window_n), "config": vars(cfg)},
                keep_last=cfg.keep_last,
                write_extra=None if mtp is None else (lambda folder: save_mtp(mtp, folder)),
            )
    bar.close()
    wall = time.perf_counter() - t0
    model.to(home)
    if mtp is not None:
        mtp.to(home)
    return SFTResult(
        steps=cfg.steps,
        final_loss=losses[-1] if losses else loss_val,
        losses=losses,
        resumed_from=resumed_from,
        wall_s=wall,
        tokens_per_s=tokens_seen / max(wall, 1e-9),
        mtp_losses=mtp_losses,
        mtp=mtp,
    )


def _new_mtp_head(model: torch.nn.Module, seed: int) -> MTPHead:
    """An MTP head for ``model`` (``MTPHead.from_target``), its random part seeded without touching the
    global RNG, so the rest of the run draws the same numbers as without a head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MTPHead.from_target(model)


def _load_mtp_into(mtp: MTPHead, ckpt: Path) -> None:
    saved = load_mtp(ckpt)
    if saved is None:
        raise ValueError(f"{ckpt}: the checkpoint has no mtp.safetensors but sft.mtp_weight > 0")
    mtp.load_state_dict(saved.state_dict())
