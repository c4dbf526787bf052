"""The replicated data-parallel trainer: `k3post.trainer.Trainer`'s interface over N ranks, each a full replica
(``distributed.fsdp.strategy=no_shard``, DDP's scheme).

    trainer = ReplicatedTrainer(model, OptimConfig(...), extra=mtp)   every rank, same weights (rank 0's broadcast)
    trainer.step(micro_batches, grads_fn, lr=lr)   rank r runs micro-batches r, r + N, ...; the gradients summed once

Why beside FSDP. `k3post.trainer.fsdp.FSDPTrainer` all-gathers every layer's parameters in its forward and backward
and reduce-scatters its gradients: on a small model on CPU cores those collectives cost more than the halved
arithmetic saves (docs/decisions.md, issue 9 §fsdp: 2 ranks 1.6-2.1x slower than one process). Here a rank runs
its share of the micro-batches with no collective at all, then the step's gradients (the model's and the
``extra`` module's, the MTP head: it trains here, unlike under FSDP) travel in one flat all-reduce; every rank
clips and steps its own optimizer on the identical sum, so the replicas stay equal (the same float operations on
the same inputs, at the same thread count; `max_drift` checks). Each micro-batch's loss is divided by the trained
tokens of the whole step (the stages' gradient functions), so the sum is the single-process gradient up to the
order of the additions. A parameter without a gradient on every rank keeps none (AdamW skips it, as in one
process: the MTP head before ``sft.mtp_start_fraction``).

Rank 0 trains the caller's model in place (a co-located engine sees every update, as with `Trainer`) and alone
reads and writes: checkpoints are `Trainer`'s single-process folders (a run resumes on any rank count and
strategy that reads them), ``named_weights`` and the export need no collective. After rank 0 changed weights or
optimizer state outside a step (a checkpoint load, the MTP head's weights restored), its next step first
broadcasts them to the other ranks (`sync`).

Driven by rank 0 like the sharded trainer (`k3post.trainer.ranks`): ``lead(command)`` sends the collective
calls (``step``, ``sync``, ``max_drift``) to the other ranks before rank 0 runs them.

Shape legend: none here (the stages' gradient functions hold the tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3post.config.optim import OptimConfig
from k3post.trainer.fsdp import sum_over_ranks
from k3post.trainer.local import Trainer

__all__ = ["ReplicatedTrainer"]


class ReplicatedTrainer(Trainer):
    """`k3post.trainer.Trainer` over the ranks of the default process group, each a full replica (module doc).
    Build it on every rank with the same model structure; rank 0's weights (and ``extra``'s) are broadcast at the
    first step. ``lead``: rank 0's command sender (`k3post.trainer.ranks.Leader.tell`); None on the other ranks."""

    share_prefix = False  # one forward per micro-batch, as under FSDP (the ranks split micro-batches)

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, *,
                 lead: Callable[[tuple[Any, ...]], None] | None = None, **trainer_kwargs: Any) -> None:
        if not dist.is_initialized():
            raise ValueError("ReplicatedTrainer needs an initialised process group (k3post.trainer.ranks.on_ranks, "
                             "or torchrun and torch.distributed.init_process_group)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._lead_fn = lead
        super().__init__(model, optim, **trainer_kwargs)
        self._stale = True  # the replicas have not received rank 0's weights yet

    def _lead(self, name: str, *args: Any, **kwargs: Any) -> None:
        """On the leading rank: have the other ranks run ``self.name(*args, **kwargs)`` too."""
        if self._lead_fn is not None:
            self._lead_fn(("call", name, args, kwargs))

    def _tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer of the model and the extra module, in a fixed order."""
        mods = [self.model] + ([self.extra] if self.extra is not None else [])
        return [t for m in mods for t in list(m.parameters()) + list(m.buffers())]

    # ----------------------------------------------------------------- replicas

    def sync(self) -> None:
        """Rank 0's weights, buffers and optimizer state onto every rank (collective)."""
        self._lead("sync")
        with torch.no_grad():
            for t in self._tensors():
                dist.broadcast(t.data, src=0)
        box = [self.optimizer.state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if self.rank != 0:
            self.optimizer.load_state_dict(box[0])
        self._stale = False

    def max_drift(self) -> float:
        """The largest |Δ| between any rank's weights and rank 0's (collective; 0 while the replicas agree)."""
        self._lead("max_drift")
        drift = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for t in self._tensors():
                ref = t.detach().clone()
                dist.broadcast(ref, src=0)
                drift = torch.maximum(drift, (t.detach() - ref).abs().max().double() if t.numel() else drift)
        dist.all_reduce(drift, op=dist.ReduceOp.MAX)
        return float(drift)

    # ----------------------------------------------------------------- steps

    def step(self, batch: Sequence[Any], grads_fn: Any, *, lr: float | None = None,
             version: int | None = None) -> dict[str, float]:
        """`Trainer.step` on every rank. A gradient function that uses the trainer's extra module (`SFTGrads` with
        the MTP head) travels without it (``shipped``) and each rank binds its own replica (``on_rank``)."""
        if self._lead_fn is not None:  # rank 0
            if self._stale:
                self.sync()
            self._lead("step", batch, grads_fn.shipped() if hasattr(grads_fn, "shipped") else grads_fn,
                       lr=lr, version=version)
        elif hasattr(grads_fn, "on_rank"):
            grads_fn = grads_fn.on_rank(self.extra)
        return super().step(batch, grads_fn, lr=lr, version=version)

    def _data_parallel(self, items: Sequence[Any], grads: Callable[[Sequence[Any], Any], dict[str, float]]) -> dict[str, float]:
        """Rank r runs ``items`` r, r + N, ... (none: no forward at all), then the gradients are summed over the
        ranks in one flat all-reduce and the sums of the gradient function added."""
        mine = list(items[self.rank::self.world])
        sums = grads(mine, None) if mine else {}
        self._all_reduce_grads()
        return sum_over_ranks(sums)

    def _all_reduce_grads(self) -> None:
        has = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        dist.all_reduce(has)  # a parameter some rank gave a gradient gets one everywhere (zeros where it had none)
        live = [p for p, h in zip(self.params, has.tolist()) if h]
        if not live:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in live])
        dist.all_reduce(flat)
        offset = 0
        for p in live:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    # ----------------------------------------------------------------- checkpoints

    def load_checkpoint(self, ckpt: str | Path) -> dict[str, Any]:
        """`Trainer.load_checkpoint` on rank 0; the other ranks receive the weights and optimizer state at the
        next step (`sync`)."""
        state = super().load_checkpoint(ckpt)
        self._stale = True
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._stale = True
