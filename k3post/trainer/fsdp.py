"""The sharded trainer: `k3post.trainer.Trainer`'s interface over N ranks with PyTorch FSDP2.

    launch_local(worker, ranks, *args)                  N local processes in one gloo / NCCL group
    trainer = FSDPTrainer(model, OptimConfig(...))       every rank, same model (same seed): fully_shard
    trainer.step(micro_batches, grads_fn, lr=lr)         one optimizer step over all ranks (Trainer's; SFT, RL, MOPD)
    trainer.named_weights()                              full (unsharded) tensors: what a weight sync sends
    trainer.save_checkpoint(root, step) / load_checkpoint(path)   torch.distributed.checkpoint (DCP)
    trainer.export_hf(folder, tokenizer)                 one consolidated safetensors folder (load_model)

Sharding. Every decoder layer is one ``fully_shard`` unit and the root (embeddings, tied LM head, final
norm) another: parameters, gradients and AdamW moments are DTensors sharded on dim 0 (for fused MoE
experts, [E, out, in], that is the expert dim). Parameters are all-gathered per layer for its forward and
backward and freed after (``reshard_after_forward``); gradients are reduce-scattered.

Data parallelism. Every rank is handed the step's micro-batches (token ids: cheap to send) and its gradient
function; rank r trains micro-batches r, r + N, r + 2N, ... Each micro-batch's loss is divided by the
trained tokens of the whole step, so the gradients of all ranks SUM to the single-process gradient: the
reduce-scatter sums (``set_gradient_divide_factor(1)``) instead of FSDP's default mean. Gradient
accumulation: the reduction is off for all but a rank's last micro-batch (``set_requires_gradient_sync``),
whose backward reduces the accumulated gradient once. All ranks must run the same number of forwards and
backwards (each is a collective), so a rank with fewer micro-batches runs zero-loss idle ones. The
shared-prompt forward of `k3post.policy_step` (two forwards per micro-batch) is off here
(``share_prefix``): every micro-batch is one forward.

QAT (`k3post.quant.qat.apply_qat`, before or after sharding) works on sharded experts unchanged: inside a
layer's forward FSDP has swapped the all-gathered (full) expert tensors in, so the fake-quant blocks along
the reduction dim see whole rows.

Checkpoints follow `k3post.checkpoint`'s layout (``step-NNNNNN/`` renamed into place, ``latest`` written
last, the newest ``keep_last`` kept); the weights and optimizer are a DCP folder ``dcp/`` inside it, keyed by
parameter name, so a checkpoint written by N ranks loads on M ranks (resharded on load).

Driven by rank 0 (`k3post.trainer.ranks`: a stage command on N ranks). Built with ``lead`` (rank 0) or
``mirror`` (every rank), the trainer trains a deep copy of the caller's model and keeps the caller's model
(rank 0's) a full copy of the trained weights: after every optimizer step and checkpoint load the ranks
all-gather the weights and rank 0 copies them in place, so a co-located engine decoding with it sees the
update as it would the single-process optimizer's, and `named_weights` on rank 0 reads it (no collective).
``lead(command)`` sends each collective call to the other ranks before rank 0 runs it.

Shape legend: none here (the stages' gradient functions hold the tensors).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from k3post import checkpoint
from k3post.config.distributed import MIXED_PRECISIONS
from k3post.config.optim import OptimConfig
from k3post.distributed.weight_sync import named_weights
from k3post.trainer.local import Trainer
from k3post.threads import exit_with_parent
from k3post.workers import start_ranks

__all__ = ["FSDPTrainer", "launch_local", "free_port", "sum_over_ranks"]

log = logging.getLogger("k3post.fsdp")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_entry(rank: int, worker: Callable[..., Any], ranks: int, port: int, backend: str, threads: int,
                args: tuple[Any, ...]) -> None:
    exit_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank))
    if threads > 0:
        torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=ranks)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def launch_local(worker: Callable[..., Any], ranks: int, *args: Any, backend: str = "gloo", threads: int = 1) -> None:
    """Run ``worker(rank, *args)`` in ``ranks`` worker processes on this machine (`k3post.workers`), in one process
    group (rendezvous on 127.0.0.1 and a free port, as torchrun's env). ``worker`` must be importable (a
    module-level function); it reports through files. ``threads``: torch threads per rank (0: torch's
    default). Raises when a rank fails (``torch.multiprocessing.ProcessRaisedException``)."""
    if ranks < 1:
        raise ValueError(f"launch_local: ranks must be >= 1, got {ranks}")
    start_ranks(_rank_entry, (worker, ranks, free_port(), backend, threads, args), ranks, join=True)


def sum_over_ranks(sums: Mapping[str, float]) -> dict[str, float]:
    """A step's sums added over the ranks of the default group, ``max/`` keys maximised (a key a rank lacks counts
    as 0, or −inf for a max). Collective."""
    # a rank without micro-batches (or without tokens of some kind) has fewer keys: agree on the union first
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(sums))
    keys = sorted(set().union(*every))
    add = torch.tensor([0.0 if k.startswith("max/") else sums.get(k, 0.0) for k in keys], dtype=torch.float64)
    top = torch.tensor([sums.get(k, -math.inf) if k.startswith("max/") else 0.0 for k in keys], dtype=torch.float64)
    dist.all_reduce(add)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return {k: float(top[i] if k.startswith("max/") else add[i]) for i, k in enumerate(keys)}


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: FSDPTrainer shards model.model.layers, which it does not have")
    return list(layers)


class FSDPTrainer(Trainer):
    """`k3post.trainer.Trainer` over the ranks of the default process group (module doc). Build it on every
    rank with the same model (same seed) and settings; every method is collective (every rank calls it, in
    the same order). ``mixed_precision`` "fp32" | "bf16" and ``cpu_offload`` are ``distributed.fsdp``'s
    (`k3post.config.distributed.FSDPConfig`); the rest is `Trainer`'s. ``step`` is `Trainer`'s, each rank
    training its share of the micro-batches."""

    share_prefix = False  # one forward per micro-batch: every rank runs the same collectives

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, *, mixed_precision: str = "fp32",
                 cpu_offload: bool = False, mirror: bool = False, lead: Callable[[tuple[Any, ...]], None] | None = None,
                 **trainer_kwargs: Any) -> None:
        if trainer_kwargs.get("extra") is not None:
            raise ValueError("sft.mtp_weight > 0: the MTP head is not supported with distributed.fsdp.ranks > 1 "
                             "(set sft.mtp_weight=0 or distributed.fsdp.ranks=1)")
        if not dist.is_initialized():
            raise ValueError("FSDPTrainer needs an initialised process group (launch_local, or torchrun and "
                             "torch.distributed.init_process_group)")
        if mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"distributed.fsdp.mixed_precision must be one of {MIXED_PRECISIONS}, got {mixed_precision!r}")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mixed_precision, self.cpu_offload = mixed_precision, cpu_offload
        self._lead_fn, self._mirrors = lead, mirror or lead is not None
        self.mirror = model if self._mirrors and self.rank == 0 else None  # the caller's model, kept full
        super().__init__(copy.deepcopy(model) if self.mirror is not None else model, optim, **trainer_kwargs)

    def _lead(self, name: str, *args: Any, **kwargs: Any) -> None:
        """On the leading rank: have the other ranks run ``self.name(*args, **kwargs)`` too."""
        if self._lead_fn is not None:
            self._lead_fn(("call", name, args, kwargs))

    def _finish(self) -> float:
        grad_norm = super()._finish()
        self._refresh_mirror()
        return grad_norm

    def _refresh_mirror(self) -> None:
        """Every rank all-gathers the weights; rank 0 copies them into the caller's model (in place)."""
        if not self._mirrors:
            return
        full = self._gather()
        if self.mirror is not None:
            with torch.no_grad():
                for (name, src), (dst_name, dst) in zip(full, named_weights(self.mirror)):
                    assert name == dst_name, (name, dst_name)
                    dst.copy_(src)

    def step(self, batch: Sequence[Any], grads_fn: Any, *, lr: float | None = None,
             version: int | None = None) -> dict[str, float]:
        self._lead("step", batch, grads_fn, lr=lr, version=version)
        return super().step(batch, grads_fn, lr=lr, version=version)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` every decoder layer, then the root; gradients summed over the ranks."""
        kw: dict[str, Any] = {}
        if self.mixed_precision == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs CUDA
        for layer in _decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # losses are normalised over all ranks' tokens: sum, not mean
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        return model

    # ----------------------------------------------------------------- steps

    def _data_parallel(self, items: Sequence[Any], grads: Callable[[Sequence[Any], Any], dict[str, float]]) -> dict[str, float]:
        """Rank r runs ``items`` r, r + N, ... with the gradient reduction on for its last backward only, then
        zero-loss idle forwards / backwards up to the busiest rank's count; the sums are added over the ranks
        (``max/`` keys maximised)."""
        mine, rounds = list(items[self.rank::self.world]), math.ceil(len(items) / self.world)
        sums = grads(mine, self._sync_on(rounds - 1))
        self._idle(len(mine), rounds)
        return self._reduce(sums)

    def _sync_on(self, last: int) -> Callable[[int], None]:
        """A ``before_backward`` that turns the gradient reduction on for backward number ``last`` only."""
        def hook(i: int) -> None:
            self.model.set_requires_gradient_sync(i == last)  # type: ignore[operator]
        return hook

    def _idle(self, done: int, total: int) -> None:
        """Backwards ``done`` .. ``total`` − 1 of this rank: zero-loss forwards and backwards, so every rank
        runs the same collectives; the last one reduces the gradients."""
        ids_BT = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        for i in range(done, total):
            logits = self.model(input_ids=ids_BT, use_cache=False).logits
            self._sync_on(total - 1)(i)
            (logits.float().sum() * 0.0).backward()

    def _reduce(self, sums: Mapping[str, float]) -> dict[str, float]:
        return sum_over_ranks(sums)

    # ----------------------------------------------------------------- weights

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter (a tied one once) and persistent buffer, in the model's
        order, as `Trainer.named_weights`: sharded parameters are all-gathered (``DTensor.full_tensor``, on
        every rank), so the tensors are copies, not the live shards. With a mirror, rank 0 alone returns the
        mirror's tensors (refreshed after every step: no collective)."""
        return named_weights(self.mirror) if self.mirror is not None else self._gather()

    def _gather(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in named_weights(self.model)]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, sharded like the parameters (DCP writes it; the
        weights are in `save_checkpoint`)."""
        return {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(self, ckpt_root: str | Path, step: int, *, tokenizer: Any = None,
                        state: Mapping[str, Any] | None = None, keep_last: int = 2,
                        write_extra: Callable[[Path], Any] | None = None) -> Path:
        """Checkpoint ``step`` in `k3post.checkpoint`'s layout: every rank writes its shards of the weights
        and the optimizer (DCP) into a staging folder, rank 0 moves it into the checkpoint as ``dcp/``
        beside ``trainer_state.pt`` (``state`` + step + world size + rank 0's RNG) and renames the whole into
        place (``write_extra(folder)`` adds rank 0's files). Returns the checkpoint folder."""
        self._lead("save_checkpoint", ckpt_root, step, keep_last=keep_last)
        root = Path(ckpt_root)
        staging = root / f".dcp-step-{step:06d}"
        if self.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        dist.barrier()
        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=staging)
        dist.barrier()
        final = root / f"step-{step:06d}"
        if self.rank == 0:
            final = checkpoint.save_checkpoint(root, step, None, tokenizer, {**dict(state or {}), "world_size": self.world},
                                               keep_last=keep_last,
                                               write_extra=lambda tmp: self._write_rank0(tmp, staging, write_extra))
        dist.barrier()
        return final

    def load_checkpoint(self, ckpt: str | Path) -> dict[str, Any]:
        """Restore weights and optimizer from a checkpoint of `save_checkpoint`, written by any number of
        ranks; returns its ``trainer_state.pt`` (the caller restores RNG and data position from it)."""
        self._lead("load_checkpoint", ckpt)
        ckpt = Path(ckpt)
        if not (ckpt / "dcp" / ".metadata").is_file():
            raise ValueError(f"{ckpt}: not a sharded checkpoint (no dcp/.metadata); a single-process checkpoint "
                             "resumes with distributed.fsdp.ranks=1")
        checkpoint.load_dcp(self.model, self.optimizer, ckpt / "dcp")
        self._refresh_mirror()
        return checkpoint.load_trainer_state(ckpt)

    @staticmethod
    def _write_rank0(folder: Path, staging: Path, write_extra: Callable[[Path], Any] | None) -> None:
        staging.rename(folder / "dcp")
        if write_extra is not None:
            write_extra(folder)

    def export_hf(self, out_dir: str | Path, tokenizer: Any = None) -> Path:
        """The consolidated model as a Hugging Face folder (``save_pretrained``: config.json + safetensors,
        the tokenizer when given) that `k3post.models.load_model` reads. The full state dict is gathered to
        rank 0's CPU, written into a temporary folder and renamed into place."""
        self._lead("export_hf", out_dir)
        out = Path(out_dir)
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            tmp = out.with_name(f".tmp-{out.name}")
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            self.model.save_pretrained(tmp, state_dict=full, safe_serialization=True)  # type: ignore[operator]
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        dist.barrier()
        return out
