"""Trainer ranks: a stage command on N processes, rank 0 running it as one process does.

    on_ranks(cfg.distributed.fsdp, run_sft, cfg)    run_sft(cfg) on rank 0; ranks 1..N-1 follow its trainer
    build_trainer(model, optim, ...)                 on rank 0: the sharded trainer (`k3post.trainer.build_trainer`)

Rank 0 owns everything but the trainer's shards: the run folder, the data, the rollout, metrics, the
report. The stage loops are the single-process ones; `k3post.trainer.build_trainer` hands them a
`k3post.distributed.fsdp.FSDPTrainer` that tells the other ranks every collective call before it runs it.
The other ranks only serve trainer calls:

    ("build", spec)               build the same model (rank 0's config and QAT scheme, its weights
                                  broadcast) and the sharded trainer over it, replacing the last one
    ("call", method, args, kw)    trainer.method(*args, **kw): step, sft_step, save / load_checkpoint, ...
    ("stop",)                     the command is done

Commands travel as pickled objects over a gloo group of their own (token ids and small metadata; the
weights travel over the trainer's process group). Launch: with ``distributed.fsdp.ranks`` = N, this
process is rank 0 and spawns N - 1 local ranks (gloo on CPU, NCCL for CUDA tensors), or, under torchrun
(``RANK`` / ``WORLD_SIZE`` set, e.g. several nodes), every process runs the command line and ranks > 0
follow. A failing rank 0 terminates the local ranks; a failing rank breaks rank 0's next collective.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from k3post.config.distributed import FSDPConfig
from k3post.config.optim import OptimConfig

__all__ = ["Leader", "leading", "on_ranks"]

log = logging.getLogger("k3post.ranks")

_LEADER: Leader | None = None


@dataclass
class Leader:
    """Rank 0's side: the FSDP settings and the command group."""

    fsdp: FSDPConfig
    control: Any  # the gloo ProcessGroup commands are broadcast over

    def tell(self, command: tuple[Any, ...]) -> None:
        dist.broadcast_object_list([command], src=0, group=self.control)

    def build_trainer(self, model: torch.nn.Module, optim: OptimConfig, **trainer_kwargs: Any) -> Any:
        """The sharded trainer of ``model`` on every rank (the others build the same model); it trains a copy
        and keeps ``model`` the full trained weights."""
        from k3post.distributed.fsdp import FSDPTrainer
        from k3post.distributed.weight_sync import module_qat

        spec = {"config": model.config, "dtype": next(model.parameters()).dtype, "qat": module_qat(model),
                "names": list(model.state_dict()), "optim": optim, "kwargs": trainer_kwargs}
        self.tell(("build", spec))
        _broadcast_weights(model)
        return FSDPTrainer(model, optim, mixed_precision=self.fsdp.mixed_precision, cpu_offload=self.fsdp.cpu_offload,
                           lead=self.tell, **trainer_kwargs)


def leading() -> Leader | None:
    """Rank 0's `Leader` while a command runs on trainer ranks, else None (one process)."""
    return _LEADER


def _broadcast_weights(model: torch.nn.Module) -> None:
    """Rank 0's parameters and persistent buffers into every rank's (same-structure) model, before sharding."""
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def _follower_trainer(spec: dict[str, Any], fsdp: FSDPConfig) -> Any:
    from transformers import AutoModelForCausalLM

    from k3post.distributed.fsdp import FSDPTrainer
    from k3post.quant.qat import apply_qat

    cfg = spec["config"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=spec["dtype"],
                                             attn_implementation=getattr(cfg, "_attn_implementation", None))
    if spec["qat"] is not None:
        apply_qat(model, spec["qat"])
    names = list(model.state_dict())
    if names != spec["names"]:
        raise RuntimeError(f"rank {dist.get_rank()}: the model built from rank 0's config has other tensors "
                           f"({sorted(set(names) ^ set(spec['names']))[:5]})")
    _broadcast_weights(model)
    return FSDPTrainer(model, spec["optim"], mixed_precision=fsdp.mixed_precision, cpu_offload=fsdp.cpu_offload,
                       mirror=True, **spec["kwargs"])


def follow(control: Any, fsdp: FSDPConfig) -> None:
    """Ranks > 0: serve rank 0's trainer commands until ``stop`` (module doc)."""
    trainer = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        command = box[0]
        if command[0] == "stop":
            return
        if command[0] == "build":
            trainer = None  # free the last one first
            trainer = _follower_trainer(command[1], fsdp)
        else:
            _, name, args, kwargs = command
            getattr(trainer, name)(*args, **kwargs)


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _init(rank: int, world: int, init_method: str) -> Any:
    """Join the process group; returns the command group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(_backend(), init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=2))
    return dist.new_group(backend="gloo")


def _follower_entry(i: int, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
    rank = i + 1
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(threads)
    control = _init(rank, world, init_method)
    try:
        follow(control, fsdp)
    finally:
        dist.destroy_process_group()


def on_ranks(fsdp: FSDPConfig, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``fsdp.ranks`` trainer ranks (module doc); returns its result on rank 0 (None on a
    torchrun follower). One rank: just ``fn(*args)``."""
    global _LEADER
    if fsdp.ranks == 1:
        return fn(*args)
    if _LEADER is not None or dist.is_initialized():
        raise RuntimeError("on_ranks: this process already is in a process group")
    procs = None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (one process per rank, any nodes)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != fsdp.ranks:
            raise ValueError(f"distributed.fsdp.ranks is {fsdp.ranks} but torchrun started WORLD_SIZE={world} processes")
        control = _init(rank, world, "env://")
    else:  # this process is rank 0 and spawns the others
        from k3post.distributed.fsdp import free_port

        rank, world, init = 0, fsdp.ranks, f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // world)
        procs = torch.multiprocessing.start_processes(_follower_entry, args=(world, init, fsdp, threads),
                                                      nprocs=world - 1, join=False, start_method="spawn")
        control = _init(0, world, init)
    if rank != 0:
        try:
            follow(control, fsdp)
        finally:
            dist.destroy_process_group()
        return None
    _LEADER = leader = Leader(fsdp, control)
    log.info("trainer ranks: %d (rank 0 runs the command)", world)
    done = False
    try:
        out = fn(*args)
        leader.tell(("stop",))
        done = True
    finally:
        _LEADER = None
        if procs is not None:
            if done:
                while not procs.join():
                    pass
            else:
                for p in procs.processes:
                    if p.is_alive():
                        p.terminate()
        dist.destroy_process_group()
    return out
