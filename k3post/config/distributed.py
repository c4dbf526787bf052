"""Scale-out settings (`k3post.trainer.fsdp.FSDPTrainer` reads ``distributed.fsdp``,
`k3post.distributed.ray_cluster.RayCluster` the Ray keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MIXED_PRECISIONS", "LAYOUTS", "ROLES", "STRATEGIES", "FSDPConfig", "RolesConfig", "DistributedConfig"]

MIXED_PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("full_shard", "no_shard")
LAYOUTS = ("colocated", "disaggregated")
ROLES = ("trainers", "engines", "env_workers", "teachers", "judges")


@dataclass
class FSDPConfig:
    """The sharded trainer (PyTorch FSDP2, ``fully_shard``).

    Fields:
        ranks: trainer processes; each holds 1/ranks of every parameter, gradient and optimizer moment
            (``full_shard``) or a whole replica (``no_shard``). 1 is the single-process `k3post.trainer.Trainer`.
        strategy: "full_shard": FSDP2 (`k3post.trainer.fsdp.FSDPTrainer`); "no_shard": every rank a full
            replica, the gradients summed once a step (`k3post.trainer.replicated.ReplicatedTrainer`, DDP's
            scheme): no collective inside the forward, so a small model on CPU cores gains from the ranks, and
            the MTP head (``sft.mtp_weight``) trains on them; single-process checkpoints.
        mixed_precision: "fp32" (no policy) or "bf16": forward / backward in bf16 (the all-gathered
            parameters are cast), gradients reduced in fp32, fp32 master weights and optimizer state.
        cpu_offload: keep the sharded parameters, gradients and optimizer state on the CPU
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        timeout_s: seconds a trainer collective (all-gather, reduce-scatter, barrier) may wait for the
            other ranks before it fails; a rank that dies is noticed at once (its connection closes), this
            bounds a rank that hangs.
        max_restarts: how often a command restarts its trainer ranks after one of them died (rank 0, this
            process, starts new ranks and runs the stage again, which resumes from its last checkpoint);
            0: the command fails and a rerun resumes. Not used under torchrun (its ``--max-restarts`` is).
    """

    ranks: int = 1
    strategy: str = "full_shard"
    mixed_precision: str = "fp32"
    cpu_offload: bool = False
    timeout_s: float = 1800.0
    max_restarts: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 1:
            raise ValueError(f"distributed.fsdp.ranks must be an int >= 1, got {self.ranks!r}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"distributed.fsdp.mixed_precision must be one of {MIXED_PRECISIONS}, "
                             f"got {self.mixed_precision!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"distributed.fsdp.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy == "no_shard" and (self.mixed_precision != "fp32" or self.cpu_offload):
            raise ValueError("distributed.fsdp.strategy=no_shard trains fp32 replicas in place: mixed_precision=bf16 "
                             "and cpu_offload are full_shard settings")
        _positive("distributed.fsdp.timeout_s", self.timeout_s)
        _count("distributed.fsdp.max_restarts", self.max_restarts, 0)


def _count(key: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{key} must be an int >= {least}, got {value!r}")


def _positive(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{key} must be a number > 0, got {value!r}")


@dataclass
class RolesConfig:
    """How many members each role group of the Ray placement group has (one bundle slot each).

    Fields:
        trainers: trainer slots: with ``fsdp.ranks`` = N > 1, rank r > 0 is a `TrainerRankActor` on slot r
            (slot 0 is this process's, rank 0; so at least N slots); `k3post experts` runs one (domain, effort)
            job per slot at a time.
        engines: rollout engine servers (`EngineServerActor`, the ``k3post serve`` engine API).
        env_workers: environment workers (`EnvWorkerActor`): every episode's environment (its tools, sandbox
            and verifier) runs in one of them; 0 runs them in the rollout's process.
        teachers: MOPD teacher actors (`TeacherActor`), the experts spread over them.
        judges: GRM judge engine servers (`EngineServerActor` s that refuse weight updates): with ``rl.judge`` a
            model folder (or "policy"), `k3post rl` and `k3post experts` serve the judge on them and every GRM
            scorer decodes there over http; 0 decodes the judge in the scorer's process. With ``rl.judge`` a URL
            it must be 0 (an error names both keys).
    """

    trainers: int = 1
    engines: int = 1
    env_workers: int = 0
    teachers: int = 0
    judges: int = 0

    def __post_init__(self) -> None:
        for role in ROLES:
            _count(f"distributed.roles.{role}", getattr(self, role), 1 if role == "trainers" else 0)


@dataclass
class DistributedConfig:
    """Settings of the multi-process modes.

    Fields:
        enabled: run the stage's roles as Ray actors and tasks in one placement group
            (`k3post.distributed.ray_cluster`; needs the ``k3post[distributed]`` extra).
        address: "local" starts a private Ray cluster on this machine; "auto" joins the one ``ray start``
            began; anything else is a cluster address (``host:port`` or ``ray://host:port``).
        num_cpus: CPUs of a "local" cluster (0: all of the machine's); ignored when joining a cluster.
        layout: "colocated": trainer rank i, engine i and the other roles share bundle i (weights stay on
            the node); "disaggregated": every role member has a bundle of its own.
        cpus_per_bundle: CPUs of each bundle (fractions allowed: 0.5 packs two bundles on a CPU); the
            members sharing a bundle split them.
        engine_max_restarts: how often Ray restarts a killed engine-server actor (on the same port, with
            the last weights it loaded); in-flight requests resume as continuations.
        task_retries: Ray retries of an expert job whose worker died (the job resumes from its checkpoints).
        env_max_restarts: how often Ray restarts a killed environment worker.
        env_retries: how often one episode's environment call is retried, from the episode's state saved
            after its last step, when its worker died (on the restarted worker or another one); past that the
            episode ends with finish "infra", kind ``env_lost`` (never a reward: masked out of its group,
            counted in ``infra/env_lost``; `k3post.loop`).
        roles: the size of each role group (`RolesConfig`).
    """

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    enabled: bool = False
    address: str = "local"
    num_cpus: int = 0
    layout: str = "colocated"
    cpus_per_bundle: float = 1.0
    engine_max_restarts: int = 3
    task_retries: int = 1
    env_max_restarts: int = 3
    env_retries: int = 2
    roles: RolesConfig = field(default_factory=RolesConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"distributed.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"distributed.address must be 'local', 'auto' or a cluster address, got {self.address!r}")
        _count("distributed.num_cpus", self.num_cpus, 0)
        if self.layout not in LAYOUTS:
            raise ValueError(f"distributed.layout must be one of {LAYOUTS}, got {self.layout!r}")
        _positive("distributed.cpus_per_bundle", self.cpus_per_bundle)
        _count("distributed.engine_max_restarts", self.engine_max_restarts, 0)
        _count("distributed.task_retries", self.task_retries, 0)
        _count("distributed.env_max_restarts", self.env_max_restarts, 0)
        _count("distributed.env_retries", self.env_retries, 0)
