"""The trainer seam: model, optimizer, device and dtype behind one object (the optimizer settings SFT
and RL share, `OptimConfig`, are in `k3post.config.optim`).

    trainer = Trainer(model, OptimConfig(lr=1e-4), device="cuda")   # the model moves to the device
    metrics = trainer.step(seqs, version=v)                          # one `policy_step`
    for name, tensor in trainer.named_weights(): ...                 # what a weight sync sends
    trainer.state_dict() / trainer.load_state_dict(...)               # the optimizer (weights: checkpoint.py)

The device is resolved once (`resolve_device`): "cuda" when asked for and present, else a clear error,
never a silent fall back to the CPU. The same code runs on either. QAT is applied to the model before it
is handed over (`k3post.quant.qat.apply_qat`); the fake-quant modules move with it.

Shape legend: none here (`k3post.policy_step` holds the tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from k3post.config.optim import OPTIMIZERS, OptimConfig
from k3post.distributed.weight_sync import named_weights
from k3post.policy_step import TokenSequence, policy_step

__all__ = ["OPTIMIZERS", "OptimConfig", "build_optimizer", "resolve_device", "Trainer"]


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


class Trainer:
    """One model and its optimizer on one device (module doc). ``loss_kwargs``, ``micro_batch_tokens``
    and ``grad_clip`` are `policy_step`'s; ``pad_id`` pads its batches."""

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
    ) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.optim_cfg = optim
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.pad_id = pad_id
        self.loss_kwargs = dict(loss_kwargs or {})
        self.micro_batch_tokens = micro_batch_tokens
        self.grad_clip = grad_clip

    def step(self, seqs: Sequence[TokenSequence], *, version: int | None = None) -> dict[str, float]:
        """One optimizer step of `policy_step` over ``seqs``; leaves the model in eval mode (the
        co-located engine decodes next)."""
        out = policy_step(self.model, self.optimizer, seqs, pad_id=self.pad_id, loss_kwargs=self.loss_kwargs,
                          micro_batch_tokens=self.micro_batch_tokens, grad_clip=self.grad_clip, version=version)
        self.model.eval()
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
