"""The rollout seam: `build_engine`, the one place engines are constructed, and `Rollout`, which owns a
stage's engine, agent loop, KV pool and partial-rollout scheduler.

    rollout = Rollout(model, tokenizer, RolloutConfig(...), effort="max", seed=0, effort_fn=...)
    rollout.add_prompts(tasks)
    groups  = rollout.run_iteration()            # partial rollout (SPEC §3.2), groups with all K samples
    ...train...
    version = rollout.push_weights(trainer)      # weights reach the engine, policy version + 1
    state   = rollout.state_dict()               # paused trajectories, KV pool tensors, version (exact resume)

With ``engine.kind = "embedded"`` the engine runs in this process over the trainer's own model: the
optimizer updates the tensors it reads, so a push is a version bump. With ``"http"`` the engine is a
client of engine servers and a push sends the weights (`k3post.config.rollout.EngineConfig`).

Shape legend: none (token lists only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from k3post.config.rollout import EngineConfig, RolloutConfig
from k3post.distributed.weight_sync import named_weights
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.engine import SamplingParams, SteppableEngine
from k3post.rollout.evaluation import make_env
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.model_drafter import ModelDrafter
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.trajectory import Group
from k3post.xtml import XTML

__all__ = ["RolloutConfig", "build_engine", "close_engine", "draft_forward", "model_drafter", "Rollout"]

log = logging.getLogger(__name__)


def _speculative(target: torch.nn.Module, cfg: EngineConfig) -> Any:
    """`SpeculativeConfig` for ``cfg.draft``: an EAGLE-3 export (its config names ``LlamaForCausalLMEagle3``)
    drives an `Eagle3Drafter` over ``target``'s embedding (features recomputed with ``target`` after a gap);
    any other model folder a `ModelDrafter`. A folder that is neither is a UserError naming it."""
    import json

    from k3post.errors import UserError
    from k3post.rollout.speculative import SpeculativeConfig

    folder = Path(cfg.draft)
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"engine.draft: {folder} is not a model folder (config.json missing)")
    if "LlamaForCausalLMEagle3" in json.loads(config.read_text()).get("architectures", []):
        from k3post.spec.drafter import Eagle3Drafter
        from k3post.spec.export import load_eagle3

        drafter: Any = Eagle3Drafter(load_eagle3(folder, target.get_input_embeddings()), target)
    else:
        from k3post.models import load_model

        drafter = model_drafter(load_model(folder).eval())
    log.info("speculative decoding: %s drafts %d tokens a round (%s)", type(drafter).__name__, cfg.num_draft_tokens,
             folder)
    return SpeculativeConfig(drafter, cfg.num_draft_tokens)


def draft_forward(model: torch.nn.Module, max_sequences: int, max_len: int, path: str = "auto") -> SteppableEngine:
    """The engine a `ModelDrafter` runs its draft model on: embedded, one slot per live sequence, no stop ids and
    no prefix sharing (the drafter manages what each slot holds), on the given forward ``path``."""
    return build_engine(model, role="draft model", max_batch_size=max_sequences, max_model_len=max_len, stop_ids=(),
                        prefix_sharing=False, path=path)


def model_drafter(model: torch.nn.Module, path: str = "auto") -> ModelDrafter:
    """A classic drafter over ``model`` (`k3post.rollout.model_drafter.ModelDrafter`) whose forward this factory
    builds (`draft_forward`) when the driving engine binds it."""
    return ModelDrafter(model, path, build_forward=draft_forward)


def build_engine(
    model: torch.nn.Module | str | Path,
    tokenizer: Any | None = None,
    *,
    engine: EngineConfig | None = None,
    role: str = "policy",
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    seed: int = 0,
    served: bool = False,
    **embedded: Any,
) -> SteppableEngine:
    """The engine of ``engine`` (default: embedded) for ``model`` (a module, or a model folder).

    ``role`` says what the engine runs: ``"policy"`` (the model being trained; `Rollout` keeps an HTTP
    engine's servers on its weights by pushes) or, for anything else, a frozen model named for logs and
    errors (``"budgets (SFT model)"``, ``"MOPD teacher general.max"``, ``"GRM judge"``). Over ``http`` the
    policy uses ``engine.urls`` when given; every other engine runs on ``engine.launch`` local servers of
    its own (`k3post.serve.launch.LocalServers`, stopped when the engine is closed), and without
    ``launch`` a frozen model over ``http`` is a ValueError: the policy's servers do not hold its weights.
    ``served``: the servers in ``engine.urls`` were started for this very model (the GRM judge's actors on
    Ray, `k3post.distributed.ray_cluster`): a frozen model's client uses them, launching nothing.
    ``embedded``: further `EmbeddedEngine` settings (``qat``, ``stop_ids``, ...); launched servers take
    ``qat`` only (the default MX scheme, as ``k3post serve --qat`` runs)."""
    cfg = engine if engine is not None else EngineConfig()
    if served and not (cfg.kind == "http" and cfg.urls):
        raise ValueError(f"the {role} is served by servers of its own, but engine.kind is {cfg.kind!r} with urls "
                         f"{list(cfg.urls)}: pass their http engine config")
    if cfg.kind == "embedded":
        from k3post.rollout.embedded import EmbeddedEngine

        if cfg.draft:
            from k3post.models import load_model

            model = load_model(model) if isinstance(model, (str, Path)) else model
            embedded = {"speculative": _speculative(model, cfg), **embedded}
        return EmbeddedEngine(model, tokenizer, max_batch_size=max_batch_size, max_model_len=max_model_len,
                              seed=seed, **{"path": cfg.forward, "qat_op_order": cfg.qat_op_order, **embedded})
    if cfg.kind == "http":
        from k3post.rollout.http_engine import HTTPEngine

        servers = None
        if (role == "policy" or served) and cfg.urls:
            urls = list(cfg.urls)
        elif cfg.launch > 0:
            servers = _launch_servers(model, tokenizer, cfg, role, max_batch_size, max_model_len, embedded)
            urls = servers.urls
        else:
            raise ValueError(f"engine.kind is http and the {role} is a model of its own, which the servers in "
                             f"engine.urls do not hold: set engine.launch to start local servers for it")
        try:
            eng = HTTPEngine(urls, seed=seed, max_retries=cfg.retries, backoff_s=cfg.backoff_s,
                             backoff_max_s=max(cfg.backoff_s, 8 * cfg.backoff_s), read_timeout_s=cfg.timeout_s,
                             weights_dir=cfg.sync_dir or None, shard_mb=cfg.bucket_mb, weight_sync=cfg.weight_sync,
                             sync_timeout_s=cfg.timeout_s, dialect="k3post" if servers is not None else cfg.dialect,
                             server_slots=cfg.server_slots or None,
                             record_routes=bool(embedded.get("record_routes")))
        except BaseException:
            if servers is not None:
                servers.close()
            raise
        if servers is not None:
            eng.on_close(servers.close)
        return eng
    raise ValueError(f"engine.kind {cfg.kind!r}: no such engine")


def _launch_servers(model: torch.nn.Module | str | Path, tokenizer: Any | None, cfg: EngineConfig, role: str,
                    max_batch_size: int, max_model_len: int | None, embedded: dict[str, Any]) -> Any:
    """``cfg.launch`` local servers running ``model`` (a module is saved to a temporary model folder, removed
    with the servers) with the QAT scheme it runs, or the one ``embedded["qat"]`` asks for."""
    import tempfile

    from k3post.distributed.weight_sync import module_qat
    from k3post.quant.qat import QATConfig
    from k3post.serve.launch import LocalServers

    extra = sorted(set(embedded) - {"qat", "record_routes", "exact"})
    if extra:
        raise ValueError(f"engine.kind is http: launched servers for the {role} take no {extra} (embedded-engine "
                         "settings)")
    qat = embedded.get("qat")
    if qat is None and isinstance(model, torch.nn.Module):
        qat = module_qat(model)
    if qat is not None and qat.enabled and qat != QATConfig():
        raise ValueError(f"engine.kind is http: launched servers run the default MX QAT scheme only; the {role} runs "
                         f"{qat}")
    tmp = None
    if isinstance(model, torch.nn.Module):
        from k3post.models import save_model

        if tokenizer is None:
            raise ValueError(f"engine.kind is http: launching servers for the {role} (a module) needs its tokenizer")
        tmp = Path(tempfile.mkdtemp(prefix="k3post-engine-model-"))
        model_dir = save_model(model, tmp / "model", tokenizer)
    else:
        model_dir = Path(model)
    servers = LocalServers(model_dir, cfg.launch, max_batch_size=max_batch_size, max_model_len=max_model_len,
                           qat=qat is not None and qat.enabled, threads=cfg.launch_threads or _plan_threads(),
                           remove_on_close=tmp, record_routes=bool(embedded.get("record_routes")),
                           exact=bool(embedded.get("exact")))
    log.info("engine for the %s: %d local server(s) %s", role, cfg.launch, servers.urls)
    return servers


def _plan_threads() -> int | None:
    """Each launched server's threads under the thread plan in force (`k3post.threads`); None without one."""
    from k3post.threads import active_plan

    plan = active_plan()
    return None if plan is None else plan[1].per_process


def close_engine(engine: Any) -> None:
    """Close ``engine`` when it holds resources (an HTTP client, servers it launched); a no-op otherwise."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


class Rollout:
    """A stage's rollout side (module doc). ``model`` is the trainer's model (the embedded engine decodes
    with it; an HTTP engine's servers hold their own copy, kept in step by `push_weights`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: RolloutConfig,
        *,
        effort: str | None = "max",
        seed: int = 0,
        effort_fn: Callable[[Any], str | None] | None = None,
    ) -> None:
        """``effort``: rendered into each prompt unless ``effort_fn`` decides; ``seed``: the engine's and the
        scheduler's."""
        self.cfg = cfg
        self.model = model
        self.engine = build_engine(model, tokenizer, engine=cfg.engine, max_batch_size=cfg.slots,
                                   max_model_len=cfg.max_model_len, seed=seed,
                                   **({"record_routes": True} if cfg.record_routes else {}),
                                   **({"exact": True} if cfg.exact else {}))
        if not getattr(self.engine, "shares_weights", False):
            # servers hold whatever they were started or last updated with: the run starts on the trainer's
            # weights, one version past the servers' (versions only ever grow on a server)
            v = self.engine.update_weights(named_weights(model))
            log.info("rollout: pushed the trainer's initial weights to %s, version %d", type(self.engine).__name__, v)
        self.loop = AgentLoop(self.engine, XTML(tokenizer), make_env,
                              sampling=SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens),
                              effort=effort, effort_fn=effort_fn)
        self.pool = KVPool(cfg.kv_pool_mb << 20)
        self.scheduler = PartialRolloutScheduler(self.loop, n_prompts=cfg.n_prompts, k=cfg.k, lambda_=cfg.lambda_,
                                                 max_staleness=cfg.max_staleness, seed=seed, kv_pool=self.pool,
                                                 max_concurrency=cfg.engine.max_concurrency or None,
                                                 reuse_stale_kv=cfg.resume_kv == "reuse")

    @property
    def version(self) -> int:
        """The policy version the engine samples with."""
        return self.engine.version

    @property
    def num_pending_prompts(self) -> int:
        return self.scheduler.num_pending_prompts

    def add_prompts(self, tasks: Sequence[Any]) -> None:
        self.scheduler.add_prompts(tasks)

    def run_iteration(self) -> list[Group]:
        """One partial-rollout iteration: the groups it completed (all K samples done)."""
        return self.scheduler.run_iteration()

    def push_weights(self, named: Callable[[], Any] | None = None, *, version: int | None = None) -> int:
        """Make the engine sample with the trainer's current weights; returns the new policy version
        (``version`` when given, else the old one + 1). The embedded engine shares the trainer's tensors,
        so only its version moves; ``named`` (a callable returning (name, tensor) pairs, e.g.
        ``trainer.named_weights``) is read only by engines that hold their own copy."""
        if getattr(self.engine, "shares_weights", False):
            return self.engine.update_weights({}, version=version)
        if named is None:
            raise ValueError(f"{type(self.engine).__name__} holds its own copy of the weights: pass named "
                             "(e.g. trainer.named_weights)")
        return self.engine.update_weights(named(), version=version)

    def refresh_weights(self) -> None:
        """After the model's tensors were replaced in place (a checkpoint loaded): re-read them."""
        refresh = getattr(self.engine, "refresh_weights", None)
        if callable(refresh):
            refresh()

    def kv_hit_rate(self) -> float:
        return self.scheduler.kv_hit_rate()

    def counters(self) -> dict[str, float]:
        """Running totals: paused KV states dropped as stale (``resume_kv=reprefill``) and, where the engine
        counts them (not servers over HTTP), the context tokens it prefilled: the price of re-prefilling; with
        speculative decoding, the tokens drafted, accepted and emitted (``spec_*``)."""
        out = {"kv_stale_dropped": float(self.scheduler.stats["kv_stale_dropped"])}
        stats = getattr(self.engine, "stats", None)
        stats = stats if isinstance(stats, Mapping) else {}
        for key in ("prefill_tokens", "spec_drafted", "spec_accepted", "spec_emitted"):  # spec_*: speculative rollout
            if stats.get(key) is not None:
                out[key] = float(stats[key])
        return out

    def paused(self) -> list[Any]:
        return self.scheduler.paused()

    def release_engine(self) -> None:
        """The engine holds no paused request of this rollout afterwards (`PartialRolloutScheduler.release_engine`)."""
        self.scheduler.release_engine()

    def state_dict(self) -> dict[str, Any]:
        """Paused and finished-but-undispatched trajectories, the KV pool's tensors (engine-resident paused
        KV is moved to the pool first) and the engine version: torch.save-able."""
        self.scheduler.offload_kv()
        return {"scheduler": self.scheduler.state_dict(), "kv_pool": self.pool.tensor_state(),
                "engine_version": self.engine.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into this (fresh) rollout, after the model's weights were loaded: an engine
        with its own copy of the weights receives them, at the saved version, or one past the servers' when
        they are already beyond it (versions only grow on a server; restored trajectories then read that
        much staler, logged)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.pool.load_tensor_state(state["kv_pool"])
        version = int(state["engine_version"])
        if not getattr(self.engine, "shares_weights", False):  # the servers get the checkpoint's weights
            push = max(version, self.engine.version + 1)
            if push != version:
                log.warning("rollout: the engine servers are at version %d, beyond the checkpoint's %d; resuming at "
                            "%d (restored trajectories read %d versions staler)", self.engine.version, version, push,
                            push - version)
            self.engine.update_weights(named_weights(self.model), version=push)
        elif version > self.engine.version:
            self.engine.update_weights({}, version=version)

    def close(self) -> None:
        self.loop.close()
        close_engine(self.engine)
