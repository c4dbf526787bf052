"""Where and how rollouts run: the engine settings every stage shares (`EngineConfig`) and one stage's
rollout (`RolloutConfig`, read by `k3post.rollout.factory.Rollout`).

``kind``:
    embedded  the in-process `EmbeddedEngine` over the trainer's own model (co-located: the engine reads
              the trainer's parameters, a weight push only bumps the policy version).
    http      engine servers (`k3post serve`, or an SGLang / vLLM server speaking the same protocol) at
              ``urls``; requests go to the least-loaded live server, weights travel by ``weight_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.config.ranges import ranged
from k3post.urls import is_url

__all__ = ["ENGINE_DIALECTS", "ENGINE_KINDS", "WEIGHT_SYNCS", "EngineConfig", "RolloutConfig"]

ENGINE_KINDS = ("embedded", "http")
ENGINE_FORWARDS = ("auto", "lean", "general")
QAT_OP_ORDERS = ("hf", "fast")
WEIGHT_SYNCS = ("disk", "distributed")
ENGINE_DIALECTS = ("k3post", "sglang", "vllm")
RESUME_KV = ("reuse", "reprefill")  # RolloutConfig.resume_kv
ROUTING_REPLAY = ("off", "measure", "rollout-routes")
"""``rl.rollout.routing_replay`` (`k3post.routing_replay`): "off" records nothing; "measure" has the engine record the experts
it routed every position to and the trainer count the positions it routes differently (``routing_mismatch_frac``)
while routing by itself; "rollout-routes" replays the engine's routes in the trainer's forward (R3)."""


@dataclass
class EngineConfig:
    """The rollout engine of a stage.

    Fields:
        kind: ``embedded`` or ``http`` (module doc).
        urls: the servers' base URLs for ``http`` (e.g. ``["http://127.0.0.1:30000"]``).
        retries: attempts per request on a server that fails before it is marked dead and its requests
            move to the others.
        backoff_s: first retry delay; doubles per attempt.
        timeout_s: one HTTP call's timeout (a generation may take long: keep it generous); also the
            ``distributed`` sync group's rendezvous and collective timeout.
        weight_sync: how the trainer's weights reach ``http`` servers: ``disk`` (safetensors in
            ``sync_dir``, which the servers must be able to read) or ``distributed``
            (torch.distributed broadcast over gloo; the servers join the trainer's group through
            ``/init_weights_update_group``).
        sync_dir: folder for ``disk`` sync (empty: the run folder's ``weights_sync``).
        bucket_mb: weights travel in buckets of at most this many MB.
        max_concurrency: most trajectories handed to the engine at once (running or queued there;
            the partial-rollout scheduler's auto-throttle ceiling); 0: the whole workload, N·K.
        launch: ``http`` only: start this many local ``k3post serve`` processes for every engine the stage
            builds that has no servers in ``urls`` (`k3post.serve.launch`): the policy's when ``urls`` is
            empty, and always the frozen models' (the SFT model of the experts' budgets and "before" row,
            the MOPD teachers' evaluation, the GRM judge), whose weights the policy's servers do not hold.
            0: nothing is launched, and a frozen model over ``http`` is an error naming it.
        launch_threads: torch CPU threads of each launched server (0: the command's thread plan, `k3post.threads`).
        dialect: the ``http`` servers' API: ``k3post`` (``k3post serve``), ``sglang`` or ``vllm``
            (their own servers; `k3post.rollout.server_dialects`: disk sync only, no exact resampling).
            Launched servers are ``k3post serve`` whatever this says.
        server_slots: requests one server decodes together, for servers that do not report it (vLLM);
            0: what the server reports.
        forward: ``embedded`` only: the engine's forward, ``auto`` (the lean forward where it reproduces the
            model exactly, else the model's own forward over a KV cache), ``lean`` (an error where it cannot)
            or ``general`` (docs/post-train-your-own-model.md).
        qat_op_order: ``embedded`` only, lean forward under QAT: ``hf`` (HF's op order: F.linear, SDPA,
            per-expert down products summed in expert order), ``fast`` (pre-transposed GEMMs, batched-GEMM decode
            attention, the routing weights folded into the down GEMM): 1.1-1.3x a decode step, 1.13x the
            rollout time of the demo's general.max RL, but a train-rollout log-prob gap ~4x larger (median per
            step 4e-6 against 1e-6), so an opt-in (docs/decisions.md, issue 32 §qatorder).
        draft: ``embedded`` only: speculative decoding with this draft folder: an EAGLE-3 export of
            `k3post draft` (``run/draft/<loss>/final``) or a small causal LM sharing the tokenizer; empty: off.
        num_draft_tokens: tokens drafted and verified per row and round when ``draft`` is set.
    """

    kind: str = "embedded"
    urls: list[str] = field(default_factory=list)
    retries: int = 3
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    weight_sync: str = "disk"
    sync_dir: str = ""
    bucket_mb: int = 64
    max_concurrency: int = 0
    launch: int = 0
    launch_threads: int = 0
    dialect: str = "k3post"
    server_slots: int = 0
    forward: str = "auto"
    qat_op_order: str = "hf"
    draft: str = ""
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine.kind must be one of {ENGINE_KINDS}, got {self.kind!r}")
        if self.forward not in ENGINE_FORWARDS:
            raise ValueError(f"engine.forward must be one of {ENGINE_FORWARDS}, got {self.forward!r}")
        if self.qat_op_order not in QAT_OP_ORDERS:
            raise ValueError(f"engine.qat_op_order must be one of {QAT_OP_ORDERS}, got {self.qat_op_order!r}")
        if self.draft and self.kind != "embedded":
            raise ValueError(f"engine.draft (speculative decoding) needs engine.kind=embedded, got {self.kind!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"engine.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.server_slots < 0:
            raise ValueError(f"engine.server_slots must be >= 0 (0: what the server reports), got {self.server_slots}")
        if self.launch < 0 or self.launch_threads < 0:
            raise ValueError(f"engine.launch and engine.launch_threads must be >= 0, got {self.launch} and "
                             f"{self.launch_threads}")
        if self.kind == "http" and not self.urls and self.launch < 1:
            raise ValueError("engine.kind is http: list the servers in engine.urls, or set engine.launch to start "
                             "local ones")
        bad = [u for u in self.urls if not is_url(u)]
        if bad:
            raise ValueError(f"engine.urls: not http(s) URLs: {bad}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"engine.weight_sync must be one of {WEIGHT_SYNCS}, got {self.weight_sync!r}")
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0 or self.bucket_mb < 1:
            raise ValueError("engine: retries >= 0, backoff_s >= 0, timeout_s > 0 and bucket_mb >= 1 are required")
        if self.dialect not in ENGINE_DIALECTS:
            raise ValueError(f"engine.dialect must be one of {ENGINE_DIALECTS}, got {self.dialect!r}")
        if self.dialect != "k3post" and self.weight_sync != "disk":
            raise ValueError(f"engine.dialect {self.dialect!r} needs engine.weight_sync=disk, got {self.weight_sync!r}")
        if self.max_concurrency < 0:
            raise ValueError(f"engine.max_concurrency must be >= 0 (0: the whole workload), got {self.max_concurrency}")


@dataclass
class RolloutConfig:
    """One stage's rollout (``rl.rollout``, `k3post.rollout.factory.Rollout`; SPEC §3.2): ``n_prompts`` × ``k`` per
    iteration, ``lambda_`` and ``max_staleness`` (partial rollout), ``temperature``, ``max_tokens`` per assistant
    turn, ``max_model_len``, ``slots`` (engine batch), ``kv_pool_mb``, ``engine`` (where it runs), and:

    ``resume_kv``: what a trajectory paused across a weight update resumes from: "reuse" its KV cache computed with
    the older weights (its next tokens are sampled from a mixed-version state; their ``kv_versions`` say so and the
    trainer counts their gap apart), or "reprefill" its context under the new weights (`k3post.rollout.scheduler`,
    ``reuse_stale_kv``).
    ``routing_replay`` (`ROUTING_REPLAY`, `k3post.routing_replay`): "off"; "measure" (the engine records each
    position's experts, the trainer counts the positions it routes differently); "rollout-routes" (the trainer routes
    them as recorded).
    ``exact``: the engine and the trainer's log-prob values run one batch-invariant forward, so every behaviour
    log-prob equals the trainer's bit for bit (`k3post.rollout.embedded.exact`; launched servers get ``--exact``);
    fails closed where it cannot hold; needs ``resume_kv`` "reprefill".
    The effort rendered into each prompt and the engine's seed are the stage's (``Rollout(effort=, seed=)``)."""

    n_prompts: int = ranged(8, ge=1)
    k: int = ranged(8, ge=1)
    lambda_: float = ranged(0.7, gt=0, le=1)
    max_staleness: int = ranged(4, ge=0)
    temperature: float = ranged(1.0, ge=0)
    max_tokens: int = ranged(128, ge=1)
    max_model_len: int = ranged(2048, ge=1)
    slots: int = ranged(32, ge=1)
    kv_pool_mb: int = ranged(64, ge=0)
    resume_kv: str = "reuse"
    routing_replay: str = "off"
    exact: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.resume_kv not in RESUME_KV:
            raise ValueError(f"rollout.resume_kv must be one of {RESUME_KV}, got {self.resume_kv!r}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"rollout.routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")
        if self.exact and self.resume_kv != "reprefill":
            raise ValueError("rollout.exact=true needs rollout.resume_kv=reprefill: a token sampled over KV kept from "
                             "older weights equals no recomputation under the new ones")

    @property
    def record_routes(self) -> bool:
        """The engine records the experts every position was routed to (routing replay, `k3post.routing_replay`)."""
        return self.routing_replay != "off"
