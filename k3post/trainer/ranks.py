"""Trainer ranks: a stage command on N processes, rank 0 running it as one process does.

    on_ranks(cfg.distributed.fsdp, run_sft, cfg)    run_sft(cfg) on rank 0; ranks 1..N-1 follow its trainer
    build_trainer(model, optim, ...)                 on rank 0: the sharded trainer (`k3post.trainer.build_trainer`)

Rank 0 owns everything but the trainer's shards: the run folder, the data, the rollout, metrics, the
report. The stage loops are the single-process ones; `k3post.trainer.build_trainer` hands them a
`k3post.trainer.fsdp.FSDPTrainer` that tells the other ranks every collective call before it runs it.
The other ranks only serve trainer calls:

    ("build", spec)               build the same model (rank 0's config and QAT scheme, its weights
                                  broadcast) and the trainer over it (sharded, or a replica with
                                  ``fsdp.strategy=no_shard``), replacing the last one
    ("call", method, args, kw)    trainer.method(*args, **kw): step (with its gradient function), save / load_checkpoint, ...
    ("stop",)                     the command is done

Commands travel as pickled objects over a gloo group of their own (token ids and small metadata; the
weights travel over the trainer's process group). Launch: with ``distributed.fsdp.ranks`` = N, this
process is rank 0 and starts N - 1 follower ranks (gloo on CPU, NCCL for CUDA tensors): local processes
(`Followers`), or with ``distributed.enabled`` Ray actors on the placement group's trainer bundles
(`k3post.distributed.ray_cluster.RayFollowers`); both run `serve_rank`. Under torchrun (``RANK`` /
``WORLD_SIZE`` set, e.g. several nodes) every process runs the command line and ranks > 0 follow.

Faults. A failing rank 0 stops the followers. A follower that dies breaks rank 0's next collective at once
(gloo: "Connection closed by peer"); one that hangs fails it after ``distributed.fsdp.timeout_s``. When a
follower died, rank 0 starts new followers and runs the stage again, which resumes from its last checkpoint
(DCP: any rank count), up to ``distributed.fsdp.max_restarts`` times.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from k3post.config.distributed import FSDPConfig
from k3post.config.optim import OptimConfig
from k3post.threads import RANKS, active_plan
from k3post.trainer.local import leading, leading_ranks
from k3post.threads import exit_with_parent
from k3post.workers import start_ranks

__all__ = ["Followers", "Leader", "on_ranks", "serve_rank"]

log = logging.getLogger("k3post.ranks")


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
        from k3post.trainer.fsdp import FSDPTrainer
        from k3post.distributed.weight_sync import module_qat

        # the extra module (the MTP head, replicated trainers only) travels whole: each rank trains a replica
        spec = {"config": model.config, "dtype": next(model.parameters()).dtype, "qat": module_qat(model),
                "names": list(model.state_dict()), "optim": optim, "kwargs": trainer_kwargs}
        self.tell(("build", spec))
        _broadcast_weights(model)
        if self.fsdp.strategy == "no_shard":
            from k3post.trainer.replicated import ReplicatedTrainer

            return ReplicatedTrainer(model, optim, lead=self.tell, **trainer_kwargs)
        return FSDPTrainer(model, optim, mixed_precision=self.fsdp.mixed_precision, cpu_offload=self.fsdp.cpu_offload,
                           lead=self.tell, **trainer_kwargs)


def _broadcast_weights(model: torch.nn.Module) -> None:
    """Rank 0's parameters and persistent buffers into every rank's (same-structure) model, before sharding."""
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def _follower_trainer(spec: dict[str, Any], fsdp: FSDPConfig) -> Any:
    from transformers import AutoModelForCausalLM

    from k3post.packed_attention import register as register_packed_attention
    from k3post.trainer.fsdp import FSDPTrainer
    from k3post.quant.qat import apply_qat

    cfg = spec["config"]
    register_packed_attention()  # rank 0's model may already run it (`k3post.packed_attention`)
    model = AutoModelForCausalLM.from_config(cfg, dtype=spec["dtype"],
                                             attn_implementation=getattr(cfg, "_attn_implementation", None))
    if spec["qat"] is not None:
        apply_qat(model, spec["qat"])
    names = list(model.state_dict())
    if names != spec["names"]:
        raise RuntimeError(f"rank {dist.get_rank()}: the model built from rank 0's config has other tensors "
                           f"({sorted(set(names) ^ set(spec['names']))[:5]})")
    _broadcast_weights(model)
    if fsdp.strategy == "no_shard":
        from k3post.trainer.replicated import ReplicatedTrainer

        return ReplicatedTrainer(model, spec["optim"], **spec["kwargs"])
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


_CONTROL_TIMEOUT = datetime.timedelta(days=7)  # the followers wait on the command group through whole rollouts


def _init(rank: int, world: int, init_method: str, timeout_s: float) -> Any:
    """Join the process group (collectives time out after ``timeout_s``); returns the command group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(_backend(), init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def serve_rank(rank: int, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
    """A follower rank's whole life: join the group at ``init_method``, serve rank 0's trainer commands until
    ``stop``, leave. What a local rank process and a Ray `TrainerRankActor` both run."""
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(threads)
    control = _init(rank, world, init_method, fsdp.timeout_s)
    try:
        follow(control, fsdp)
    finally:
        dist.destroy_process_group()


def _follower_entry(i: int, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
    exit_with_parent()
    serve_rank(i + 1, world, init_method, fsdp, threads)


class Followers:
    """Ranks 1..N-1 of one attempt: started, watched, stopped. This class runs them as local processes
    (`k3post.workers`); `k3post.distributed.ray_cluster.RayFollowers` as Ray actors on the trainer bundles."""

    host = "127.0.0.1"  # where rank 0 listens for the rendezvous

    def start(self, world: int, init_method: str, fsdp: FSDPConfig, threads: int) -> None:
        self.procs = start_ranks(_follower_entry, (world, init_method, fsdp, threads), world - 1, join=False)

    def lost(self, wait_s: float) -> list[str]:
        """The followers that died (one line each), waiting up to ``wait_s`` for a death to show."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})"
                    for i, p in enumerate(self.procs.processes) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.1)

    def join(self) -> None:
        """After ``stop``: wait for every follower to exit (raises when one failed)."""
        while not self.procs.join():
            pass

    def terminate(self) -> None:
        for p in self.procs.processes:
            if p.is_alive():
                p.terminate()


def _run_leader(fsdp: FSDPConfig, followers: Followers, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """One attempt: start the followers, run ``fn(*args)`` as rank 0, stop them. A failure is re-raised
    with ``lost_ranks`` (the followers that died, one line each) set on the exception."""
    world = fsdp.ranks
    with socket.socket() as s:  # a port on the address the followers reach rank 0 at
        s.bind((followers.host, 0))
        init = f"tcp://{followers.host}:{s.getsockname()[1]}"
    plan = active_plan()  # a plan that counts the local ranks gives each its share (k3post.threads); else rank 0's
    local = plan is not None and RANKS in plan[1].workers
    followers.start(world, init, fsdp, plan[1].per_process if local else max(1, torch.get_num_threads() // world))
    done = False
    try:
        control = _init(0, world, init, fsdp.timeout_s)
        try:
            with leading_ranks(Leader(fsdp, control)) as leader:
                out = fn(*args)
                leader.tell(("stop",))
                done = True
        finally:
            dist.destroy_process_group()
        followers.join()
        return out
    except Exception as e:
        # a collective that failed (RuntimeError, DistError) may be a follower's death Ray or the OS has not
        # reported yet: wait for it a little; any other error is rank 0's own
        lost = [] if done else followers.lost(wait_s=10.0 if isinstance(e, RuntimeError) else 0.0)
        e.lost_ranks = lost  # type: ignore[attr-defined]
        raise
    finally:
        if not done:
            followers.terminate()


def on_ranks(fsdp: FSDPConfig, fn: Callable[..., Any], *args: Any,
             followers: Callable[[], Followers] = Followers) -> Any:
    """``fn(*args)`` with ``fsdp.ranks`` trainer ranks (module doc); returns its result on rank 0 (None on a
    torchrun follower). One rank: just ``fn(*args)``. ``followers`` makes each attempt's ranks 1..N-1
    (local processes by default; Ray actors: `k3post.distributed.ray_cluster.RayFollowers`). When one of them
    dies, rank 0 starts new ones and runs ``fn`` again (it resumes from the stage's last checkpoint), up to
    ``fsdp.max_restarts`` times; then the error says which rank was lost."""
    if fsdp.ranks == 1:
        return fn(*args)
    if leading() is not None or dist.is_initialized():
        raise RuntimeError("on_ranks: this process already is in a process group")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (one process per rank, any nodes)
        return _under_torchrun(fsdp, fn, args)
    for attempt in range(fsdp.max_restarts + 1):
        try:
            log.info("trainer ranks: %d (rank 0 runs the command)%s", fsdp.ranks,
                     f", restart {attempt} of {fsdp.max_restarts}" if attempt else "")
            return _run_leader(fsdp, followers(), fn, args)
        except Exception as e:
            lost = getattr(e, "lost_ranks", [])
            if not lost:
                raise
            if attempt == fsdp.max_restarts:
                raise RuntimeError(f"trainer {'; '.join(lost)} died and distributed.fsdp.max_restarts="
                                   f"{fsdp.max_restarts} restarts are used up; running the command again resumes "
                                   f"from the last checkpoint ({type(e).__name__}: {e})") from e
            log.warning("trainer %s died (%s: %s); starting new trainer ranks, the stage resumes from its last "
                        "checkpoint (restart %d of distributed.fsdp.max_restarts=%d)", "; ".join(lost),
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "", attempt + 1, fsdp.max_restarts)
    raise AssertionError("unreachable")


def _under_torchrun(fsdp: FSDPConfig, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Every process of a torchrun job runs the command line: rank 0 runs ``fn``, the others follow."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != fsdp.ranks:
        raise ValueError(f"distributed.fsdp.ranks is {fsdp.ranks} but torchrun started WORLD_SIZE={world} processes")
    control = _init(rank, world, "env://", fsdp.timeout_s)
    try:
        if rank != 0:
            follow(control, fsdp)
            return None
        with leading_ranks(Leader(fsdp, control)) as leader:
            out = fn(*args)
            leader.tell(("stop",))
        return out
    finally:
        dist.destroy_process_group()
