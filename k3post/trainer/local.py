"""The trainer seam: model, optimizer, device and dtype behind one object that knows no algorithm (the
optimizer settings every stage shares, `OptimConfig`, are in `k3post.config.optim`).

    trainer = Trainer(model, OptimConfig(lr=1e-4), device="cuda")   # the model moves to the device
    sums = trainer.step(micro_batches, grads_fn, lr=lr, version=v)   # one optimizer step (below)
    for name, tensor in trainer.named_weights(): ...                 # what a weight sync sends
    trainer.save_checkpoint(root, step, state=...) / state = trainer.load_checkpoint(ckpt)   # weights + optimizer
    trainer.state_dict() / trainer.load_state_dict(...)               # the optimizer alone

One step: zero the gradients, ``grads_fn`` (a `Grads`: the stage's forward and backward over a list of
micro-batches) accumulates them, clip, optimizer step. Each stage passes its own gradient function and
turns the sums it returns into its metrics: SFT `k3post.stages.sft.SFTGrads` (`k3post.stages.sft.sft_step`), RL and MOPD
`k3post.policy_step.PolicyGrads` (`k3post.policy_step.train_policy_step`), the EAGLE-3 draft
`k3post.spec.train.DraftGrads`.

`build_trainer` is what a stage calls: this `Trainer`, or, when the command runs on trainer ranks
(``distributed.fsdp.ranks`` > 1, `k3post.trainer.ranks.on_ranks`), the sharded
`k3post.trainer.fsdp.FSDPTrainer` that rank 0 drives. Either trains the caller's ``model``: this one in
place, the sharded one a copy whose full weights it copies back into ``model`` after every step.

The device is resolved once (`resolve_device`): "cuda" when asked for and present, else a clear error,
never a silent fall back to the CPU. The same code runs on either. QAT is applied to the model before it
is handed over (`k3post.quant.qat.apply_qat`); the fake-quant modules move with it.

Shape legend: none here (the stages' gradient functions hold the tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from k3post import checkpoint
from k3post.config.optim import OPTIMIZERS, OptimConfig
from k3post.distributed.weight_sync import named_weights

if TYPE_CHECKING:
    from k3post.trainer.ranks import Leader

__all__ = ["OPTIMIZERS", "OptimConfig", "Grads", "build_optimizer", "build_trainer", "clip_grad_norm", "leading",
           "leading_ranks", "resolve_device", "Trainer"]

_LEADER: Leader | None = None


class Grads(Protocol):
    """A stage's gradient function, what `Trainer.step` is handed: forward and backward of the stage's loss over
    ``micro_batches`` (all of a step's on one process, one rank's share on a sharded trainer), gradients
    accumulated into the model's ``.grad`` (not zeroed here), each micro-batch's loss already divided by the
    whole step's normaliser so that the shares of all ranks add up to the step's gradient. ``before_backward(i)``
    runs before the i-th backward (a sharded trainer turns its gradient reduction on for the last one);
    ``version`` is the policy version of the weights being trained, for a function that measures against it.
    Returns sums that add over the ranks (a key starting ``max/`` is a maximum). A sharded trainer sends it to
    its other ranks: it must pickle (a module-level class holding plain data)."""

    def __call__(self, model: torch.nn.Module, micro_batches: Sequence[Any], *, version: int | None,
                 before_backward: Callable[[int], None] | None) -> dict[str, float]: ...


def clip_grad_norm(params: Sequence[torch.Tensor], grad_clip: float) -> float:
    """The global L2 norm of the gradients of ``params``; with ``grad_clip`` > 0 they are scaled so that it is at
    most ``grad_clip`` (``torch.nn.utils.clip_grad_norm_``). Sharded (DTensor) gradients give the norm over every
    shard (a collective: every rank calls it)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if hasattr(total, "full_tensor"):  # DTensor: the partial norms of the shards, reduced over the ranks
        total = total.full_tensor()
    if grad_clip > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, total)
    return float(total)


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
    if extra is not None and leader.fsdp.strategy != "no_shard":
        raise ValueError("sft.mtp_weight > 0: the MTP head is not supported with distributed.fsdp.ranks > 1 and "
                         "strategy=full_shard (set distributed.fsdp.strategy=no_shard, sft.mtp_weight=0 or "
                         "distributed.fsdp.ranks=1)")
    return leader.build_trainer(model, optim, **({"extra": extra} if extra is not None else {}), **trainer_kwargs)


class Trainer:
    """One model and its optimizer on one device (module doc). ``grad_clip``: the gradient norm a step clips to
    (0: none); ``pad_id`` pads the idle forwards of a sharded trainer. ``extra``: a module trained beside the
    model (the MTP head), its parameters after the model's in the optimizer. ``clip_extra_apart``: the extra
    module's gradient is clipped to ``grad_clip`` on its own norm and the model's on the model's (the step's
    ``grad_norm`` is then the model's), so a module trained on detached inputs cannot shrink the model's update;
    otherwise one global norm over both. ``extra_lr_scale``: the extra module's learning rate is this multiple of the
    model's (a parameter group of its own; 1: one group, as before)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        device: str | torch.device = "cpu",
        pad_id: int = 0,
        grad_clip: float = 1.0,
        extra: torch.nn.Module | None = None,
        clip_extra_apart: bool = False,
        extra_lr_scale: float = 1.0,
    ) -> None:
        self.device = resolve_device(device)
        self.model = self._wrap(model.to(self.device))
        self.extra = extra.to(self.device) if extra is not None else None
        self.optim_cfg = optim
        self._model_params = [p for p in self.model.parameters() if p.requires_grad]
        self._extra_params = list(self.extra.parameters()) if self.extra is not None else []
        self.params = self._model_params + self._extra_params
        if self._extra_params and extra_lr_scale != 1.0:
            self.optimizer = build_optimizer([{"params": self._model_params},
                                              {"params": self._extra_params, "lr_scale": float(extra_lr_scale)}], optim)
            self._set_lr(optim.lr)
        else:
            self.optimizer = build_optimizer(self.params, optim)
        self.pad_id = pad_id
        self.grad_clip = grad_clip
        self.clip_extra_apart = clip_extra_apart and bool(self._extra_params)

    # what a data-parallel trainer (k3post.trainer.fsdp.FSDPTrainer) replaces
    share_prefix = True  # a prompt shared by several sequences may run once (False: one forward per micro-batch)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the optimizer trains (here: as given)."""
        return model

    def _data_parallel(self, items: Sequence[Any], grads: Callable[[Sequence[Any], Any], dict[str, float]]) -> dict[str, float]:
        """``grads(share, before_backward)`` over this process's share of the step's micro-batches ``items`` (here:
        all of them, no hook); returns its sums, added over every process."""
        return grads(items, None)

    def _finish(self) -> float:
        """Clip, optimizer step, eval mode (the co-located engine decodes next); returns the gradient norm (the
        model's alone with ``clip_extra_apart``)."""
        if self.clip_extra_apart:
            grad_norm = clip_grad_norm(self._model_params, self.grad_clip)
            clip_grad_norm(self._extra_params, self.grad_clip)
        else:
            grad_norm = clip_grad_norm(self.params, self.grad_clip)
        self.optimizer.step()
        self.model.eval()
        return grad_norm

    def _set_lr(self, lr: float | None) -> None:
        """Every parameter group's learning rate becomes ``lr`` times the group's ``lr_scale`` (1 unless set; None:
        unchanged); it stays set for later steps."""
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)

    def step(self, batch: Sequence[Any], grads_fn: Grads, *, lr: float | None = None,
             version: int | None = None) -> dict[str, float]:
        """One optimizer step at learning rate ``lr`` (None: the optimizer's current one; a given one stays set):
        gradients zeroed, ``grads_fn`` over the micro-batches ``batch`` (`Grads`; ``version`` is passed on), clip,
        optimizer step; leaves the model in eval mode. Returns ``grads_fn``'s sums (over every rank) and
        ``grad_norm``. An empty ``batch`` only sets the learning rate and returns {}."""
        self._set_lr(lr)
        if not batch:
            return {}
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._data_parallel(batch, lambda share, hook: grads_fn(self.model, share, version=version,
                                                                       before_backward=hook))
        return {**sums, "grad_norm": self._finish()}

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
