"""The trainer side of RL and on-policy distillation: one optimizer step of the policy loss over
token sequences (STYLE.md 4: "one trainer, many signals").

The trainer does not know which algorithm produced its input. It receives, per sequence, the
context tokens, which of them the model sampled (the loss mask), the behaviour log-prob the rollout
engine recorded for each sampled token, and a per-token advantage: the group advantage broadcast
over a response for RL (SPEC §3.1), the clipped teacher − student log-ratio for MOPD (SPEC §4).

    logp_BT[b, t] = log π_θ(ids[b, t] | ids[b, <t])           one forward per micro-batch (t ≥ 1)
    loss          = policy_loss(logp, behaviour, A, mask, token_normalizer=N)
    N             = sampled tokens of the whole step, so micro-batches sum to the token mean

Micro-batches are formed by length (longest first) under ``micro_batch_tokens`` padded tokens, so
gradient accumulation equals one large batch (tested).

Through the trainer (`k3post.trainer.Trainer`, which knows no loss): `train_policy_step(trainer, seqs, ...)` plans
the micro-batches and hands them to ``trainer.step`` with `PolicyGrads` (this module's `policy_grads`) as the
gradient function; `policy_step` is the same step over a bare model and optimizer.

Shared prompts. The K samples of a group share their prompt (every token before the first sampled one).
Such sequences go into micro-batches of their own, where the prompt runs through the model once (batch
1) and its KV cache is broadcast to the K rows, which run only their own tokens:

    prefix  = model(ids[:P])                      one row, use_cache
    rest    = model(ids[:, P:], cache = prefix's KV expanded to K rows, positions P..)
    logp    = log_softmax([prefix logits at P−1, rest logits])[ids[:, P:]]

Gradients flow through the broadcast cache into the prefix forward, so log-probs and gradients equal the
full forward's up to fp32 summation order (tested: 1e-6 / 1e-5), at the cost of P + Σ suffixes tokens
instead of K·(P + suffix). A model whose cache the trainer cannot broadcast uses the full forward (logged).

Shape legend: B sequences, T positions (right-padded), V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3post.algos.policy_loss import policy_loss
from k3post.quant.qat import weight_quant_cache
from k3post.rollout.embedded.exact import exact_forward_for
from k3post.routing_replay import RouteReplay, pad_routes
from k3post.scoring import micro_batches, shared_prefix_logprobs, token_logprobs
from k3post.trainer.local import clip_grad_norm

__all__ = ["TokenSequence", "plan_micro_batches", "policy_grads", "PolicyGrads", "step_metrics", "train_policy_step", "policy_step"]

log = logging.getLogger(__name__)
_NO_SHARED_PREFIX: set[str] = set()  # model classes already logged as using the full forward


@dataclass
class TokenSequence:
    """One training sequence: context tokens with per-token provenance.

    Fields (all of length T):
        token_ids: the whole context (prompt, sampled tokens, environment tokens).
        mask: True for tokens the model sampled (the only ones with a loss).
        behavior_logp: log π_old of each sampled token as the rollout engine recorded it (0 elsewhere).
        advantages: per-token advantage (0 where mask is False).
        versions: optional, the policy version that sampled each token (-1 elsewhere), as the rollout
            engine stamped it; `policy_step` measures the train–rollout gap on the tokens sampled by the
            weights it trains.
        kv_versions: optional, per sampled token the oldest policy version among the KV entries it
            attended to (-1: unknown), as the engine stamped it (`GenerationResult.output_kv_versions`):
            a token sampled by the trained weights over KV computed before their update has its gap
            counted apart (``rollout_gap_stale_kv_*``).
        routes: optional, [<= T, M, K] int: the experts the engine routed context position t to in each MoE
            layer (-1: unknown; `GenerationResult.routes`). The trainer counts the positions it routes
            differently (``routing_mismatch_frac``) and, with routing replay on, routes them as recorded
            (`k3post.routing_replay.RouteReplay`).
    """

    token_ids: list[int]
    mask: list[bool]
    behavior_logp: list[float]
    advantages: list[float]
    versions: list[int] | None = None
    kv_versions: list[int] | None = None
    routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] > n):
            raise ValueError(f"TokenSequence: routes shaped {tuple(self.routes.shape)}, expected [<= {n} positions, "
                             "MoE layers, top_k]")
        if not (len(self.mask) == len(self.behavior_logp) == len(self.advantages) == n) or any(
            x is not None and len(x) != n for x in (self.versions, self.kv_versions)
        ):
            raise ValueError(
                f"TokenSequence fields differ in length: token_ids {n}, mask {len(self.mask)}, "
                f"behavior_logp {len(self.behavior_logp)}, advantages {len(self.advantages)}"
                + (f", versions {len(self.versions)}" if self.versions is not None else "")
                + (f", kv_versions {len(self.kv_versions)}" if self.kv_versions is not None else "")
            )
        if n and self.mask[0]:
            raise ValueError("TokenSequence: the first token cannot be trainable (nothing predicts it)")

    @property
    def num_trainable(self) -> int:
        return sum(self.mask)


def _prompt_len(s: TokenSequence) -> int:
    """Tokens before the first sampled one (the prompt a group's samples share)."""
    return s.mask.index(True) if True in s.mask else len(s.token_ids)


def plan_micro_batches(seqs: Sequence[TokenSequence], micro_batch_tokens: int, *, share_prefix: bool = True,
                       min_prefix: int = 16) -> list[tuple[list[int], int]]:
    """Micro-batches as (indices, shared prefix length). With ``share_prefix``, sequences that share a
    prompt of at least ``min_prefix`` tokens are batched together, longest suffix first, under
    P + rows × longest suffix ≤ ``micro_batch_tokens``, with prefix length P; every other sequence goes
    through `micro_batches` with prefix 0 (the full forward)."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    groups: dict[tuple[int, ...], list[int]] = {}
    if share_prefix:
        for i, s in enumerate(seqs):
            P = _prompt_len(s)
            if min_prefix <= P < len(s.token_ids):
                groups.setdefault(tuple(s.token_ids[:P]), []).append(i)
    out: list[tuple[list[int], int]] = []
    shared: set[int] = set()
    for prompt, idx in groups.items():
        if len(idx) < 2:
            continue
        P = len(prompt)
        shared.update(idx)
        cur: list[int] = []
        for i in sorted(idx, key=lambda j: (-(len(seqs[j].token_ids) - P), j)):
            suffix0 = len(seqs[cur[0]].token_ids) - P if cur else len(seqs[i].token_ids) - P
            if cur and P + (len(cur) + 1) * suffix0 > micro_batch_tokens:
                out.append((cur, P))
                cur = []
            cur.append(i)
        out.append((cur, P))
    rest = [i for i in range(len(seqs)) if i not in shared]
    out += [([rest[j] for j in mb], 0) for mb in micro_batches([len(seqs[i].token_ids) for i in rest], micro_batch_tokens)]
    return out


def _collate(seqs: Sequence[TokenSequence], pad_id: int, version: int | None = None,
             device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors on ``device`` (built on the CPU, moved once). With ``version``, the sampled
    tokens are sorted by provenance: ``fresh`` (sampled by ``version`` over KV of that version, or of an unknown
    one), ``stale_kv`` (sampled by ``version`` over KV older than it) and ``moved`` (sampled by an older
    version: the policy has moved since)."""
    T = max(len(s.token_ids) for s in seqs)
    B = len(seqs)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    attn_BT = torch.zeros((B, T), dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.bool)
    fresh_BT = torch.zeros((B, T), dtype=torch.bool)
    stale_kv_BT = torch.zeros((B, T), dtype=torch.bool)
    moved_BT = torch.zeros((B, T), dtype=torch.bool)
    beh_BT = torch.zeros((B, T), dtype=torch.float32)
    adv_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, s in enumerate(seqs):
        n = len(s.token_ids)
        ids_BT[b, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attn_BT[b, :n] = 1
        mask_BT[b, :n] = torch.tensor(s.mask, dtype=torch.bool)
        if version is not None and s.versions is not None:
            v_T = torch.tensor(s.versions, dtype=torch.long)
            same_T = mask_BT[b, :n] & (v_T == version)
            if s.kv_versions is not None:
                kv_T = torch.tensor(s.kv_versions, dtype=torch.long)
                stale_kv_BT[b, :n] = same_T & (kv_T >= 0) & (kv_T < version)
            fresh_BT[b, :n] = same_T & ~stale_kv_BT[b, :n]
            moved_BT[b, :n] = mask_BT[b, :n] & (v_T >= 0) & (v_T < version)
        beh_BT[b, :n] = torch.tensor(s.behavior_logp, dtype=torch.float32)
        adv_BT[b, :n] = torch.tensor(s.advantages, dtype=torch.float32)
    out = {"ids": ids_BT, "attn": attn_BT, "mask": mask_BT, "fresh": fresh_BT, "stale_kv": stale_kv_BT,
           "moved": moved_BT, "behavior": beh_BT, "adv": adv_BT}
    shapes = {tuple(s.routes.shape[1:]) for s in seqs if s.routes is not None}
    if len(shapes) > 1:
        raise ValueError(f"TokenSequence routes of one batch have different [MoE layers, top_k]: {sorted(shapes)}")
    if shapes:  # routes, and which of them the trained weights computed: every position before a fresh token
        M, K = shapes.pop()
        out["routes"] = pad_routes([s.routes for s in seqs], T, M, K).long()
        fresh_B1 = (fresh_BT * torch.arange(T)).max(dim=1, keepdim=True).values  # the last fresh token's index
        if version is None or any(s.versions is None for s in seqs):  # provenance unknown: all the trained weights'
            fresh_B1[torch.tensor([version is None or s.versions is None for s in seqs])] = T
        out["routes_fresh"] = torch.arange(T)[None, :] < fresh_B1
    if device is not None and torch.device(device).type != "cpu":
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out


def policy_grads(
    model: torch.nn.Module,
    groups: Sequence[tuple[Sequence[TokenSequence], int]],
    *,
    pad_id: int,
    token_normalizer: float,
    loss_kwargs: Mapping[str, Any] | None = None,
    version: int | None = None,
    before_backward: Callable[[int], None] | None = None,
    routing_replay: bool = False,
    exact: bool = False,
) -> dict[str, float]:
    """Forward and backward of `policy_loss` over the micro-batches ``groups`` (each its sequences and their
    shared prefix length, as `plan_micro_batches` plans them), gradients accumulated into ``model``'s ``.grad``
    (not zeroed here), each micro-batch's loss divided by ``token_normalizer`` (the sampled tokens of the whole
    step, over every rank). ``before_backward(i)`` runs before the i-th backward (a sharded trainer turns its
    gradient reduction on for the last one).

    Returns sums to combine over ranks: ``loss``, ``forward_tokens``, ``gap_sum``, ``gap_n`` (and
    ``stale_kv_gap_sum`` / ``_n``, ``moved_gap_sum`` / ``_n``: the gap on the tokens `_collate` sorts apart),
    ``tokens`` (sampled tokens seen), ``sum/<metric>`` (policy_loss's metrics × their tokens), and maxima
    ``max/gap``, ``max/stale_kv_gap``, ``max/max_abs_log_ratio``.

    Sequences with recorded routes (`TokenSequence.routes`) add ``routes_known`` (positions with a record that
    the trained weights computed: every position before a ``fresh`` token) and ``routes_mismatched`` (those the
    trainer's own top-k routes differently in some MoE layer: the engine's mismatch), and ``routes_known_older`` /
    ``routes_mismatched_older`` for the other recorded positions (computed by older weights: the policy moved);
    with ``routing_replay`` the forward routes every recorded position as recorded
    (`k3post.routing_replay.RouteReplay`).

    ``exact`` (``rl.rollout.exact``): the log-probs' values come from the exact forward
    (`k3post.rollout.embedded.exact`), the engine's own, and their gradient from the model's forward:
    ``logp = exact + (hf − hf.detach())``. A token the trained weights sampled (``fresh``) whose recorded log-prob
    differs from it by any amount raises RuntimeError (fail closed: the exact mode's promise is broken)."""
    kwargs = dict(loss_kwargs or {})
    replay = None
    if any(s.routes is not None for group, _ in groups for s in group):
        replay = RouteReplay(model)
        replay.replay = bool(routing_replay)
    try:
        out = _policy_grads(model, groups, pad_id=pad_id, token_normalizer=token_normalizer, kwargs=kwargs,
                            version=version, before_backward=before_backward, replay=replay, exact=exact)
    finally:
        if replay is not None:
            replay.remove()
    if replay is not None:
        out.update(routes_known=float(replay.known), routes_mismatched=float(replay.mismatched),
                   routes_known_older=float(replay.known_older), routes_mismatched_older=float(replay.mismatched_older))
    return out


def _policy_grads(model: torch.nn.Module, groups: Sequence[tuple[Sequence[TokenSequence], int]], *, pad_id: int,
                  token_normalizer: float, kwargs: dict[str, Any], version: int | None,
                  before_backward: Callable[[int], None] | None, replay: RouteReplay | None,
                  exact: bool = False) -> dict[str, float]:
    device = next(model.parameters()).device
    out: dict[str, float] = {"loss": 0.0, "forward_tokens": 0.0, "gap_sum": 0.0, "gap_n": 0.0, "tokens": 0.0,
                             "stale_kv_gap_sum": 0.0, "stale_kv_gap_n": 0.0, "moved_gap_sum": 0.0, "moved_gap_n": 0.0,
                             "max/gap": 0.0, "max/stale_kv_gap": 0.0, "max/max_abs_log_ratio": 0.0}
    with weight_quant_cache(model):  # the weights are the same in every micro-batch: QAT quantizes them once
        for i, (group, prefix) in enumerate(groups):
            batch = _collate(group, pad_id, version, device)
            routes = (batch["routes"], batch["routes_fresh"]) if "routes" in batch else None
            got = None
            if prefix:
                got = shared_prefix_logprobs(model, batch["ids"], batch["attn"], prefix, entropy_mask_BT=batch["mask"],
                                             replay=replay, routes=routes)
                if got is None and type(model).__name__ not in _NO_SHARED_PREFIX:
                    _NO_SHARED_PREFIX.add(type(model).__name__)
                    log.warning("%s: its KV cache cannot be broadcast to the samples of a group; the trainer runs "
                                "their shared prompt once per sample", type(model).__name__)
            logp_BT, ent_BT = got if got is not None else token_logprobs(
                model, batch["ids"], batch["attn"], entropy_mask_BT=batch["mask"], replay=replay, routes=routes)
            B, T = batch["ids"].shape
            out["forward_tokens"] += prefix + B * (T - prefix) if got is not None else B * T
            if exact:  # the engine's values, the model's gradient
                exact_BT = exact_forward_for(model, T).token_logprobs(batch["ids"], prefix, batch["mask"])
                logp_BT = exact_BT + (logp_BT - logp_BT.detach())
            with torch.no_grad():
                d_BT = (logp_BT.detach() - batch["behavior"]).abs()
                if exact:
                    _check_exact(logp_BT.detach(), batch, group, version)
                for key, sel in (("gap", "fresh"), ("stale_kv_gap", "stale_kv"), ("moved_gap", "moved")):
                    gap_N = d_BT[batch[sel]]
                    if gap_N.numel():
                        out[f"{key}_sum"] += float(gap_N.sum())
                        out[f"{key}_n"] += gap_N.numel()
                        if f"max/{key}" in out:
                            out[f"max/{key}"] = max(out[f"max/{key}"], float(gap_N.max()))
            loss, m = policy_loss(
                logp_BT, batch["behavior"], batch["adv"], batch["mask"], token_normalizer=float(token_normalizer),
                entropy_BT=ent_BT, **kwargs,
            )
            if before_backward is not None:
                before_backward(i)
            loss.backward()
            out["loss"] += float(loss.detach())
            n = m["num_tokens"]
            out["tokens"] += n
            for k, v in m.items():
                if k == "max_abs_log_ratio":
                    out["max/max_abs_log_ratio"] = max(out["max/max_abs_log_ratio"], v)
                elif k != "num_tokens":
                    out[f"sum/{k}"] = out.get(f"sum/{k}", 0.0) + v * n
    return out


def _check_exact(logp_BT: torch.Tensor, batch: Mapping[str, torch.Tensor], group: Sequence[TokenSequence],
                 version: int | None) -> None:
    """RuntimeError naming the first token the trained weights sampled whose recorded log-prob is not the exact
    forward's (``rl.rollout.exact``)."""
    bad_BT = batch["fresh"] & (logp_BT != batch["behavior"])
    if bool(bad_BT.any()):
        b, t = (int(i) for i in bad_BT.nonzero()[0])
        raise RuntimeError(
            f"rl.rollout.exact: {int(bad_BT.sum())} token(s) sampled by version {version} have a recorded log-prob other than "
            f"the trainer's exact forward (first: sequence {b} of its micro-batch, position {t}, token "
            f"{group[b].token_ids[t]}: recorded {float(batch['behavior'][b, t])!r}, recomputed "
            f"{float(logp_BT[b, t])!r}). The engine did not "
            "run the exact forward on these weights (an HTTP server started without --exact, other weights), or this "
            "machine's kernels are not batch-invariant")


def step_metrics(sums: Mapping[str, float], *, n_total: int, n_seqs: int, micro_batches: int, grad_norm: float,
                 version: int | None) -> dict[str, float]:
    """`policy_step`'s metrics from the sums of `policy_grads` (of one rank, or added over all ranks)."""
    out = {k.removeprefix("sum/"): v / n_total for k, v in sums.items() if k.startswith("sum/")}
    out.update(
        loss=sums["loss"], grad_norm=grad_norm, max_abs_log_ratio=sums["max/max_abs_log_ratio"],
        num_tokens=float(n_total), num_sequences=float(n_seqs), micro_batches=float(micro_batches),
        forward_tokens=float(sums["forward_tokens"]),
    )
    if version is not None:
        n = sums["gap_n"]
        out.update(rollout_gap_mean=sums["gap_sum"] / n if n else float("nan"), rollout_gap_max=sums["max/gap"],
                   rollout_gap_tokens=float(n))
        ns, nm = sums["stale_kv_gap_n"], sums["moved_gap_n"]
        out.update(rollout_gap_stale_kv_tokens=float(ns), policy_moved_gap_tokens=float(nm))
        if ns:  # means and maxima only where there were such tokens (no NaN in the step's row)
            out.update(rollout_gap_stale_kv_mean=sums["stale_kv_gap_sum"] / ns,
                       rollout_gap_stale_kv_max=sums["max/stale_kv_gap"])
        if nm:
            out.update(policy_moved_gap_mean=sums["moved_gap_sum"] / nm)
    known, older = sums.get("routes_known", 0.0), sums.get("routes_known_older", 0.0)
    if known:  # routes recorded by the engine: the share of positions the trainer routes differently
        out.update(routing_known_tokens=known, routing_mismatch_frac=sums["routes_mismatched"] / known)
    if older:  # ... and of those older weights routed (the policy moved since)
        out.update(routing_older_tokens=older, routing_older_mismatch_frac=sums["routes_mismatched_older"] / older)
    return out


@dataclass(frozen=True)
class PolicyGrads:
    """`policy_grads` as a trainer's gradient function (`k3post.trainer.local.Grads`): micro-batches are
    (sequences, shared prefix length); ``token_normalizer`` is the sampled tokens of the whole step."""

    pad_id: int
    token_normalizer: float
    loss_kwargs: Mapping[str, Any] | None = None
    routing_replay: bool = False
    exact: bool = False

    def __call__(self, model: torch.nn.Module, micro_batches: Sequence[tuple[Sequence[TokenSequence], int]], *,
                 version: int | None = None, before_backward: Callable[[int], None] | None = None) -> dict[str, float]:
        return policy_grads(model, micro_batches, pad_id=self.pad_id, token_normalizer=self.token_normalizer,
                            loss_kwargs=self.loss_kwargs, version=version, before_backward=before_backward,
                            routing_replay=self.routing_replay, exact=self.exact)


def train_policy_step(trainer: Any, seqs: Sequence[TokenSequence], *, pad_id: int,
                      loss_kwargs: Mapping[str, Any] | None = None, micro_batch_tokens: int = 8192,
                      version: int | None = None, lr: float | None = None,
                      routing_replay: bool = False, exact: bool = False) -> dict[str, float]:
    """One optimizer step of `policy_loss` over ``seqs`` through ``trainer`` (`k3post.trainer.Trainer.step` with
    `PolicyGrads`), at learning rate ``lr`` (None: the trainer's current one): the sequences with sampled tokens,
    planned into micro-batches of ``micro_batch_tokens`` (shared prompts run once when the trainer allows it,
    ``trainer.share_prefix``). Returns `policy_step`'s metrics; with no sampled token only the learning rate is
    set. ``routing_replay``: route the sequences' recorded routes as the engine did; ``exact``: the exact forward's
    log-prob values (`policy_grads`)."""
    seqs = [s for s in seqs if s.num_trainable > 0]
    if not seqs:
        trainer.step([], PolicyGrads(pad_id, 0.0, loss_kwargs, routing_replay, exact), lr=lr, version=version)
        return {"num_tokens": 0.0, "num_sequences": 0.0}
    n_total = sum(s.num_trainable for s in seqs)
    groups = plan_micro_batches(seqs, micro_batch_tokens, share_prefix=trainer.share_prefix)
    sums = trainer.step([([seqs[j] for j in idx], prefix) for idx, prefix in groups],
                        PolicyGrads(pad_id, n_total, loss_kwargs, routing_replay, exact), lr=lr, version=version)
    return step_metrics(sums, n_total=n_total, n_seqs=len(seqs), micro_batches=len(groups),
                        grad_norm=sums["grad_norm"], version=version)


def policy_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    seqs: Sequence[TokenSequence],
    *,
    pad_id: int,
    loss_kwargs: Mapping[str, Any] | None = None,
    micro_batch_tokens: int = 8192,
    grad_clip: float = 1.0,
    version: int | None = None,
    share_prefix: bool = True,
) -> dict[str, float]:
    """One optimizer step of `policy_loss` over ``seqs`` (module doc). Returns metrics: loss,
    grad_norm, the token-weighted means of policy_loss's metrics, max_abs_log_ratio (max), forward_tokens
    (positions the training forward ran, padding included: a shared prompt counts once),
    entropy, train_rollout_logp_gap (mean |logp − behaviour| over sampled tokens, measured by
    the same forward that trains: staleness included), num_tokens, num_sequences, micro_batches.

    With ``version`` (the policy version of the weights being trained), also the train–rollout gap
    proper, over the sampled tokens stamped with that version (``TokenSequence.versions``): the same
    weights on both sides, so |logp − behaviour| is what the trainer's forward and the rollout engine's
    forward disagree on (kernels, QAT paths), not staleness: rollout_gap_mean, rollout_gap_max and
    rollout_gap_tokens (SPEC §5: measured and logged every step).

    ``share_prefix``: run a prompt shared by several sequences once per micro-batch (module doc)."""
    seqs = [s for s in seqs if s.num_trainable > 0]
    if not seqs:
        return {"num_tokens": 0.0, "num_sequences": 0.0}
    n_total = sum(s.num_trainable for s in seqs)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    groups = plan_micro_batches(seqs, micro_batch_tokens, share_prefix=share_prefix)
    sums = policy_grads(model, [([seqs[j] for j in idx], prefix) for idx, prefix in groups], pad_id=pad_id,
                        token_normalizer=n_total, loss_kwargs=loss_kwargs, version=version)
    grad_norm = clip_grad_norm([p for p in model.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    return step_metrics(sums, n_total=n_total, n_seqs=len(seqs), micro_batches=len(groups), grad_norm=grad_norm,
                        version=version)
