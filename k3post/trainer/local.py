"""The trainer seam: model, optimizer, device and dtype behind one object (the optimizer settings SFT
and RL share, `OptimConfig`, are in `k3post.config.optim`).

    trainer = Trainer(model, OptimConfig(lr=1e-4), device="cuda")   # the model moves to the device
    metrics = trainer.step(seqs, version=v)                          # one `policy_step`
    metrics = trainer.sft_step(batches, lr=lr)                       # one SFT step (`k3post.sft.sft_grads`)
    for name, tensor in trainer.named_weights(): ...                 # what a weight sync sends
    trainer.save_checkpoint(root, step, state=...) / state = trainer.load_checkpoint(ckpt)   # weights + optimizer
    trainer.state_dict() / trainer.load_state_dict(...)               # the optimizer alone

`build_trainer` is what a stage calls: this `Trainer`, or, when the command runs on trainer ranks
(``distributed.fsdp.ranks`` > 1, `k3post.trainer.ranks.on_ranks`), the sharded
`k3post.trainer.fsdp.FSDPTrainer` that rank 0 drives. Either trains the caller's ``model``: this one in
place, the sharded one a copy whose full weights it copies back into ``model`` after every step.

The device is resolved once (`resolve_device`): "cuda" when asked for and present, else a clear error,
never a silent fall back to the CPU. The same code runs on either. QAT is applied to the model before it
is handed over (`k3post.quant.qat.apply_qat`); the fake-quant modules move with it.

Shape legend: none here (`k3post.policy_step` holds the tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3post import checkpoint
from k3post.config.optim import OPTIMIZERS, OptimConfig
from k3post.distributed.weight_sync import named_weights
from k3post.data import PackedBatch
from k3post.policy_step import TokenSequence, clip_grad_norm, plan_micro_batches, policy_grads, step_metrics

if TYPE_CHECKING:
    from k3post.trainer.ranks import Leader

__all__ = ["OPTIMIZERS", "OptimConfig", "build_optimizer", "build_trainer", "leading", "leading_ranks", "resolve_device",
           "Trainer"]

_LEADER: Leader | None = None


def build_optimizer(params: Any, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over ``params`` (an iterable of tensors or of param groups)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(float(cfg.betas[0]), float(cfg.betas[1])), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device; ValueError when it names CUDA and none is present (no silent CPU)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def leading() -> Leader | None:
    """Rank 0's `k3post.trainer.ranks.Leader` while a command runs on trainer ranks, else None (one process)."""
    return _LEADER


@contextmanager
def leading_ranks(leader: Leader) -> Iterator[Leader]:
    """While the block runs, `build_trainer` asks ``leader`` for the sharded trainer (`k3post.trainer.ranks`
    enters it around the command rank 0 runs)."""
    global _LEADER
    if _LEADER is not None:
        raise RuntimeError("leading_ranks: this process already leads trainer ranks")
    _LEADER = leader
    try:
        yield leader
    finally:
        _LEADER = None


def build_trainer(model: torch.nn.Module, optim: OptimConfig, *, extra: torch.nn.Module | None = None,
                  **trainer_kwargs: Any) -> "Trainer":
    """The trainer of ``model`` for this process (module doc): a `Trainer`, or on rank 0 of trainer ranks
    (`k3post.trainer.ranks.on_ranks`) the sharded trainer the other ranks follow. ``extra`` (the MTP
    head) and ``trainer_kwargs`` are `Trainer`'s."""
    leader = leading()
    if leader is None:
        return Trainer(model, optim, extra=extra, **trainer_kwargs)
    if extra is not None:
        raise ValueError("sft.mtp_weight > 0: the MTP head is not supported with distributed.fsdp.ranks > 1 "
                         "(set sft.mtp_weight=0 or distributed.fsdp.ranks=1)")
    return leader.build_trainer(model, optim, **trainer_kwargs)


class Trainer:
    """One model and its optimizer on one device (module doc). ``loss_kwargs``, ``micro_batch_tokens``
    and ``grad_clip`` are `policy_step`'s; ``pad_id`` pads its batches. ``extra``: a module trained beside
    the model by `sft_step` (the MTP head), its parameters after the model's in the optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        device: str | torch.device = "cpu",
        pad_id: int = 0,
        loss_kwargs: Mapping[str, Any] | None = None,
        micro_batch_tokens: int = 8192,
        grad_clip: float = 1.0,
        extra: torch.nn.Module | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.model = self._wrap(model.to(self.device))
        self.extra = extra.to(self.device) if extra is not None else None
        self.optim_cfg = optim
        self.params = [p for p in self.model.parameters() if p.requires_grad] + (
            list(self.extra.parameters()) if self.extra is not None else [])
        self.optimizer = build_optimizer(self.params, optim)
        self.pad_id = pad_id
        self.loss_kwargs = dict(loss_kwargs or {})
        self.micro_batch_tokens = micro_batch_tokens
        self.grad_clip = grad_clip

    # what a data-parallel trainer (k3post.trainer.fsdp.FSDPTrainer) replaces
    share_prefix = True  # `policy_step`'s shared-prompt forward

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the optimizer trains (here: as given)."""
        return model

    def _data_parallel(self, items: Sequence[Any], grads: Callable[[Sequence[Any], Any], dict[str, float]]) -> dict[str, float]:
        """``grads(share, before_backward)`` over this process's share of the step's micro-batches ``items`` (here:
        all of them, no hook); returns its sums, added over every process."""
        return grads(items, None)

    def _finish(self) -> float:
        """Clip, optimizer step, eval mode (the co-located engine decodes next); returns the gradient norm."""
        grad_norm = clip_grad_norm(self.params, self.grad_clip)
        self.optimizer.step()
        self.model.eval()
        return grad_norm

    def _set_lr(self, lr: float | None) -> None:
        """Every parameter group's learning rate becomes ``lr`` (None: unchanged); it stays set for later steps."""
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr

    def step(self, seqs: Sequence[TokenSequence], *, version: int | None = None, lr: float | None = None) -> dict[str, float]:
        """One optimizer step of `policy_step` over ``seqs`` (its metrics) at learning rate ``lr`` (None: the
        optimizer's current one; a given one stays set); leaves the model in eval mode."""
        self._set_lr(lr)
        seqs = [s for s in seqs if s.num_trainable > 0]
        if not seqs:
            return {"num_tokens": 0.0, "num_sequences": 0.0}
        n_total = sum(s.num_trainable for s in seqs)
        groups = plan_micro_batches(seqs, self.micro_batch_tokens, share_prefix=self.share_prefix)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._data_parallel(groups, lambda share, hook: policy_grads(
            self.model, seqs, share, pad_id=self.pad_id, token_normalizer=n_total, loss_kwargs=self.loss_kwargs,
            version=version, before_backward=hook))
        return step_metrics(sums, n_total=n_total, n_seqs=len(seqs), micro_batches=len(groups),
                            grad_norm=self._finish(), version=version)

    def sft_step(self, batches: Sequence[PackedBatch], *, lr: float | None = None, precision: str = "fp32",
                 mtp_weight: float = 0.0) -> dict[str, float]:
        """One SFT optimizer step (`k3post.sft.sft_grads`, the token mean over ``batches``) at learning rate ``lr``
        (None: unchanged); with ``mtp_weight`` > 0 the ``extra`` module is the MTP head and its loss is added.
        Returns loss, grad_norm, target_tokens (and mtp_loss)."""
        from k3post.sft import sft_grads
        from k3post.spec.mtp import mtp_labels

        mtp = self.extra if mtp_weight > 0 else None
        if mtp_weight > 0 and mtp is None:
            raise ValueError("sft_step: mtp_weight > 0 needs the trainer's extra module (the MTP head)")
        n_tok = sum(b.n_target_tokens for b in batches)
        n_mtp = sum(int((mtp_labels(b.labels_RL, b.position_ids_RL) != -100).sum()) for b in batches) if mtp else 0
        self._set_lr(lr)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._data_parallel(batches, lambda share, hook: dict(zip(("loss", "mtp_loss"), sft_grads(
            self.model, share, n_tok=n_tok, precision=precision, mtp=mtp, mtp_weight=mtp_weight, n_mtp=n_mtp,
            before_backward=hook))))
        out = {"loss": sums["loss"] / max(n_tok, 1), "grad_norm": self._finish(), "target_tokens": float(n_tok)}
        if mtp is not None:
            out["mtp_loss"] = sums["mtp_loss"] / max(n_mtp, 1)
        return out

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, detached tensor) of every parameter (a tied one once) and persistent buffer, in the
        model's order: what a weight sync sends (`k3post.distributed.weight_sync.named_weights`). The
        tensors alias the live ones (copy before the next step if kept)."""
        return named_weights(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state (the weights are saved by `k3post.checkpoint`)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, ckpt_root: str | Path, step: int, *, tokenizer: Any = None,
                        state: Mapping[str, Any] | None = None, keep_last: int = 2,
                        write_extra: Callable[[Path], Any] | None = None) -> Path:
        """Checkpoint ``step`` (`k3post.checkpoint.save_checkpoint`): the model as an HF folder, ``state`` and the
        optimizer in ``trainer_state.pt``; returns the checkpoint folder."""
        return checkpoint.save_checkpoint(ckpt_root, step, self.model, tokenizer, {**dict(state or {}), **self.state_dict()},
                                          keep_last=keep_last, write_extra=write_extra)

    def load_checkpoint(self, ckpt: str | Path) -> dict[str, Any]:
        """Restore weights and optimizer from a checkpoint of `save_checkpoint`, or of a sharded trainer on any
        number of ranks (its ``dcp/`` folder); returns its ``trainer_state.pt`` (the caller restores RNG and data
        position from it)."""
        ckpt = Path(ckpt)
        state = checkpoint.load_trainer_state(ckpt)
        if (ckpt / "dcp").is_dir():
            if self.extra is not None:
                raise ValueError(f"{ckpt}: a sharded checkpoint holds no weights for the trainer's extra module")
            checkpoint.load_dcp(self.model, self.optimizer, ckpt / "dcp")
        else:
            checkpoint.load_weights_into(self.model, ckpt)
            self.load_state_dict(state)
        return state
