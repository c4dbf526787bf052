"""Routing replay for MoE models (R3): the experts the rollout engine routed each token to, recorded per
position and MoE layer, and replayed by the trainer's forward.

Why. The log-prob the trainer recomputes for a sampled token should be the one the engine sampled it from.
In an MoE the top-k choice is discrete: a last-bit difference between the engine's forward and the trainer's
(MXFP8 rounding under QAT, a bf16 engine against an fp32 trainer, the rows a server batched together) can
flip a near-tie and send a token through another expert, a log-prob gap far larger than the rounding that
caused it. Replaying the engine's choice removes that flip; the trainer still computes its own gating weights.

The engine side. ``RouteCache`` holds, parallel to the slot KV cache, ``routes[slot, position, m, k]``: the
k-th expert position ``position`` of the sequence in ``slot`` went to in MoE layer m (int16; -1 where
unknown). It moves with the KV: copied for prefix sharing and slot moves, exported into `KVState` on pause
and for kept multi-turn KV, loaded back on resume. ``RouteRecorder`` fills it: a forward names the (slot,
position) of each of its N rows (``RouteRecorder.rows``), then every MoE layer hands its chosen experts e_NK to
``record`` (the lean forward's dense MoE directly, any router module through a forward hook). A finished,
paused or aborted request returns the routes of its context positions 0..n-1 (every position the engine fed:
prompt, tool results and sampled tokens but the last) in `GenerationResult.routes`; they travel in
`Trajectory.routes` and `TokenSequence.routes`, and over HTTP as ``encode_routes`` text.

The trainer side. ``RouteReplay`` wraps each MoE layer's router module with a forward hook. Inside
``RouteReplay.replaying(routes_NMK)`` (rows as the forward flattens them, -1 where nothing was recorded) the
router's output (logits, weights, experts) becomes (logits, w, e) with

    e_NK = recorded experts (the router's own top-k on rows without a record)
    p_NX = softmax(logits_NX);   w_nk = p[n, e_nk]  (/ sum_k p[n, e_nk] when the router renormalises)

so gradients reach the router through the replayed experts' probabilities, as in R3. On rows whose record
equals the router's own choice, w is bit for bit the router's own (the same softmax, gather and divide), so
replay changes nothing where nothing differs. With ``replay=False`` the hook only counts: ``known`` rows with a
record, ``mismatched`` those whose own top-k set differs from the record in at least one layer; rows the caller
marks as recorded under older weights (``fresh_N`` False: the policy has moved since) are counted apart, in
``known_older`` / ``mismatched_older``.

Shape legend:
    S  slots;  C  positions of capacity;  N  rows of a forward;  M  MoE layers;  K  experts per token;
    X  routed experts;  T  positions of one sequence
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from k3post.config.rollout import ROUTING_REPLAY

__all__ = ["ROUTING_REPLAY_MODES", "RouteCache", "RouteRecorder", "RouteReplay", "decode_routes", "encode_routes",
           "check_replayable", "moe_routers", "pad_routes", "route_shape", "softmax_topk_rule"]

ROUTING_REPLAY_MODES = ROUTING_REPLAY  # rl.rollout.routing_replay's choices (defined with the torch-free config)

_ROUTE_DTYPE = torch.int16


def moe_routers(model: nn.Module, *, probe: bool = True) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every routed-experts layer of ``model`` (its
    ``model.layers[i].mlp.gate`` or ``.router``), checked to be a top-k router whose choice can be recorded: one
    ``weight`` [X, D], an int ``top_k`` and, with ``probe``, a forward that returns (logits [N, X], weights [N, K],
    experts [N, K] int) on a probe input (the trainer checks its outputs at each forward instead: a sharded module
    cannot run alone). ValueError naming the layer otherwise, and when the model has no routed-experts layer.
    Replaying needs more (`check_replayable`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"routing replay: {type(model).__name__} has no model.layers")
    out: list[tuple[int, nn.Module]] = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
        if gate is None or getattr(mlp, "experts", None) is None:
            continue  # a dense MLP layer (mlp_only_layers): nothing to route
        w = getattr(gate, "weight", None)
        if not (isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(getattr(gate, "top_k", None), int)):
            raise ValueError(f"routing replay: layer {i}'s router {type(gate).__name__} is not a top-k router with one "
                             "weight [experts, hidden] and an int top_k")
        if not probe:
            out.append((i, gate))
            continue
        with torch.no_grad():
            got = gate(torch.zeros(2, w.shape[1], dtype=w.dtype, device=w.device))
        _check_router_output(i, gate, got, 2)
        out.append((i, gate))
    if not out:
        raise ValueError(f"routing replay: {type(model).__name__} has no routed-experts layer")
    return out


def _check_router_output(li: int, gate: nn.Module, out: Any, n: int) -> None:
    """ValueError unless ``out`` is (logits [n, X], weights [n, K], experts [n, K] int)."""
    K = gate.top_k
    if not (isinstance(out, tuple) and len(out) == 3 and out[0].dim() == 2 and out[0].shape[0] == n
            and tuple(out[1].shape) == tuple(out[2].shape) == (n, K) and not out[2].is_floating_point()):
        raise ValueError(f"routing replay: layer {li}'s router {type(gate).__name__} does not return "
                         "(logits [N, experts], weights [N, top_k], experts [N, top_k])")


def check_replayable(model: nn.Module) -> None:
    """ValueError naming the first router whose weights replay could not recompute: on a probe input its experts must
    be the top-k of p = softmax(its logits) and its weights p or p / sum p at them (`_output_rule`; Qwen-MoE's,
    Mixtral's and gpt-oss's routers are, DeepSeek-V3's grouped sigmoid router is not). Run on the unsharded model
    before training (``rl.rollout.routing_replay=rollout-routes``); the trainer's hooks check each router's output again at its first replayed forward of every step."""
    for li, gate in moe_routers(model):
        w = gate.weight
        h_ND = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        with torch.no_grad():
            logits_NX, w_NK, e_NK = gate(h_ND)
            _output_rule(li, gate, torch.softmax(logits_NX, dtype=torch.float, dim=-1), w_NK, e_NK)


def route_shape(model: nn.Module, *, probe: bool = True) -> tuple[dict[int, int], int, int]:
    """({decoder layer: MoE layer index m}, M, K) of ``model``'s routers (`moe_routers`)."""
    routers = moe_routers(model, probe=probe)
    ks = {int(g.top_k) for _, g in routers}  # type: ignore[arg-type]
    if len(ks) != 1:
        raise ValueError(f"routing replay: the routers pick different numbers of experts {sorted(ks)}")
    return {li: m for m, (li, _) in enumerate(routers)}, len(routers), ks.pop()


def encode_routes(routes_TMK: torch.Tensor) -> str:
    """Routes [T, M, K] as text: ``"TxMxK:"`` + base64 of int16 little-endian (JSON, HTTP)."""
    T, M, K = routes_TMK.shape
    raw = routes_TMK.to(_ROUTE_DTYPE).contiguous().numpy().astype("<i2").tobytes()
    return f"{T}x{M}x{K}:" + base64.b64encode(raw).decode("ascii")


def decode_routes(text: str, where: str = "routes") -> torch.Tensor:
    """Inverse of `encode_routes` ([T, M, K] int16); ValueError naming ``where`` on malformed text."""
    import numpy as np

    try:
        head, body = text.split(":", 1)
        T, M, K = (int(x) for x in head.split("x"))
        arr = np.frombuffer(base64.b64decode(body, validate=True), dtype="<i2")
        if min(T, M, K) < 0 or arr.size != T * M * K:
            raise ValueError(f"{arr.size} values for shape {T}x{M}x{K}")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: not encoded routes ('TxMxK:' + base64 int16): {e}") from None
    return torch.from_numpy(arr.astype(np.int16)).view(T, M, K)


class RouteCache:
    """``routes[s, c, m, k]`` of S slots and C positions (module doc), -1 where unknown; grows like the KV cache."""

    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, *, max_len: int, device: torch.device,
                 initial_capacity: int = 128) -> None:
        self.num_slots, self.M, self.K, self.max_len, self.device = num_slots, num_moe_layers, top_k, max_len, device
        self.capacity = min(initial_capacity, max_len)
        self.routes = torch.full((num_slots, self.capacity, self.M, self.K), -1, dtype=_ROUTE_DTYPE, device=device)

    def ensure_capacity(self, needed: int) -> None:
        """Grow C to at least ``needed`` (at least doubling, capped at max_len)."""
        if needed <= self.capacity:
            return
        cap = min(max(needed, 2 * self.capacity), self.max_len)
        new = torch.full((self.num_slots, cap, self.M, self.K), -1, dtype=_ROUTE_DTYPE, device=self.device)
        new[:, : self.capacity] = self.routes
        self.routes, self.capacity = new, cap

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Positions 0..length-1 of slot ``src`` into slot ``dst``."""
        if src != dst and length:
            self.routes[dst, :length] = self.routes[src, :length]

    def export(self, slot: int, length: int) -> torch.Tensor:
        """A CPU copy of positions 0..length-1 of ``slot``: [length, M, K]."""
        return self.routes[slot, :length].to("cpu", copy=True)

    def load(self, slot: int, length: int, routes_NMK: torch.Tensor | None) -> None:
        """Positions 0..length-1 of ``slot`` from an exported state (-1 when it has none)."""
        self.ensure_capacity(length)
        if routes_NMK is None:
            self.routes[slot, :length] = -1
            return
        if tuple(routes_NMK.shape) != (length, self.M, self.K):
            raise ValueError(f"routes of a KV state are shaped {tuple(routes_NMK.shape)}, this engine records "
                             f"[{length}, {self.M}, {self.K}]")
        self.routes[slot, :length] = routes_NMK.to(self.device, _ROUTE_DTYPE)


class RouteRecorder:
    """Writes each forward's routes into a `RouteCache` (module doc). It hooks the model's routers when built
    (for forwards that call them as modules); a forward runs inside ``rows`` (its rows' slots and positions),
    and each MoE layer's choice reaches ``record`` (directly or through the hook)."""

    def __init__(self, model: nn.Module, num_slots: int, max_len: int, device: torch.device) -> None:
        self.layer_m, M, K = route_shape(model)
        self.cache = RouteCache(num_slots, M, K, max_len=max_len, device=device)
        self._dst: torch.Tensor | None = None  # [n] flat (slot * C + position) targets of the recorded rows
        self._src: torch.Tensor | None = None  # [n] rows of the forward they come from (None: all, in order)
        self._hooks = [gate.register_forward_hook(self._hook(li)) for li, gate in moe_routers(model)]

    def _hook(self, li: int) -> Any:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            if self._dst is not None:
                self.record(li, out[2])
        return hook

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @contextmanager
    def rows(self, slots_N: torch.Tensor, pos_N: torch.Tensor, valid_N: torch.Tensor | None = None) -> Iterator[None]:
        """Record the forward run inside: its row n is position ``pos_N[n]`` of slot ``slots_N[n]`` (only rows
        where ``valid_N`` holds are recorded: padding is not)."""
        self.cache.ensure_capacity(int(pos_N.max()) + 1)
        dst = slots_N.to(torch.long) * self.cache.capacity + pos_N.to(torch.long)
        self._src = None
        if valid_N is not None and not bool(valid_N.all()):
            self._src = valid_N.nonzero().squeeze(1)
            dst = dst[self._src]
        self._dst = dst.to(self.cache.device)
        try:
            yield
        finally:
            self._dst = self._src = None

    def record(self, li: int, e_NK: torch.Tensor) -> None:
        """Layer ``li``'s experts for the rows named by ``rows`` (a no-op outside it)."""
        if self._dst is None:
            return
        c = self.cache
        e = e_NK.reshape(-1, c.K)
        if self._src is not None:
            e = e[self._src]
        c.routes.view(-1, c.M, c.K)[self._dst, self.layer_m[li]] = e.to(_ROUTE_DTYPE)


class RouteReplay:
    """The trainer side (module doc): hooks on ``model``'s routers that replay recorded routes inside
    ``replaying`` and count rows routed differently. Counters: ``known`` (rows with a record),
    ``mismatched`` (rows whose own top-k differs from the record in at least one MoE layer), and the same for rows
    recorded under older weights, ``known_older`` / ``mismatched_older``."""

    def __init__(self, model: nn.Module) -> None:
        self.layer_m, self.M, self.K = route_shape(model, probe=False)
        self.known = self.mismatched = self.known_older = self.mismatched_older = 0
        self.replay = False
        self._routes: torch.Tensor | None = None  # [N, M, K] of the current forward
        self._differ: torch.Tensor | None = None  # [N] bool: own routing differs in some layer so far
        self._rule: dict[int, bool] = {}  # MoE layer -> renormalises (read off its first replayed output)
        self._hooks = [gate.register_forward_hook(self._hook(li)) for li, gate in moe_routers(model, probe=False)]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, li: int) -> Any:
        m = self.layer_m[li]

        def hook(module: nn.Module, _args: Any, out: Any) -> Any:
            if self._routes is None:
                return None
            _check_router_output(li, module, out, out[0].shape[0] if isinstance(out, tuple) and out else -1)
            logits_NX, w_NK, own_NK = out
            rec_NK = self._routes[:, m].to(own_NK.device, own_NK.dtype)
            if rec_NK.shape != own_NK.shape:
                raise ValueError(f"routing replay: layer {li}'s router saw {own_NK.shape[0]} rows, the recorded routes "
                                 f"cover {rec_NK.shape[0]}")
            known_N = rec_NK[:, 0] >= 0
            with torch.no_grad():
                d_N = (own_NK.sort(dim=-1).values != rec_NK.sort(dim=-1).values).any(dim=-1) & known_N
                self._differ = d_N if self._differ is None else self._differ | d_N
            if not self.replay:
                return None
            e_NK = torch.where(known_N[:, None], rec_NK, own_NK)
            p_NX = torch.softmax(logits_NX, dtype=torch.float, dim=-1)
            p_NK = p_NX.gather(1, e_NK)
            if m not in self._rule:  # a router's rule is its structure: checked once per RouteReplay (training step)
                self._rule[m] = _output_rule(li, module, p_NX, w_NK, own_NK)
            if self._rule[m]:
                p_NK = p_NK / p_NK.sum(dim=-1, keepdim=True)
            return logits_NX, p_NK.to(w_NK.dtype), e_NK
        return hook

    @contextmanager
    def replaying(self, routes_NMK: torch.Tensor | None, fresh_N: torch.Tensor | None = None) -> Iterator[None]:
        """Forwards inside use ``routes_NMK`` (rows in the order the model flattens its input, [B*T]; None:
        nothing recorded, the hooks stand by); rows with a record are counted when the block ends, into ``known`` /
        ``mismatched``, or, where ``fresh_N`` is False (recorded under older weights), ``known_older`` /
        ``mismatched_older``."""
        self._routes, self._differ = routes_NMK, None
        try:
            yield
        finally:
            if routes_NMK is not None:
                known_N = (routes_NMK[:, 0, 0] >= 0).cpu()
                differ_N = self._differ.cpu() if self._differ is not None else torch.zeros_like(known_N)
                fresh = torch.ones_like(known_N) if fresh_N is None else fresh_N.reshape(-1).bool().cpu()
                self.known += int((known_N & fresh).sum())
                self.mismatched += int((differ_N & fresh).sum())
                self.known_older += int((known_N & ~fresh).sum())
                self.mismatched_older += int((differ_N & ~fresh).sum())
            self._routes = self._differ = None


def softmax_topk_rule(p_NX: torch.Tensor, w_NK: torch.Tensor, e_NK: torch.Tensor, k: int,
                      order: Sequence[bool] = (True, False)) -> bool | None:
    """Which softmax top-k rule a router's output (weights ``w_NK``, experts ``e_NK``) follows, given p = softmax of
    its logits: its experts are the top-``k`` of p, and its weights p / sum_k p (True) or p (False) at them, tried in
    ``order``. None when neither (a grouped, biased or sigmoid router)."""
    with torch.no_grad():
        top_NK, want_e_NK = torch.topk(p_NX, k, dim=-1)
        if e_NK.shape != want_e_NK.shape or not torch.equal(e_NK, want_e_NK):
            return None
        w = w_NK.float()
        for norm in order:
            if torch.allclose(w, top_NK / top_NK.sum(-1, keepdim=True) if norm else top_NK, rtol=1e-5, atol=1e-7):
                return bool(norm)
    return None


def _output_rule(li: int, router: nn.Module, p_NX: torch.Tensor, w_NK: torch.Tensor, own_NK: torch.Tensor) -> bool:
    """Whether ``router`` renormalises its top-k probabilities, read off this forward's own output
    (`softmax_topk_rule`; the trainer cannot probe a sharded module), its ``norm_topk_prob`` tried first when it has
    one. ValueError naming the layer when it follows neither rule (a grouped, biased or sigmoid router)."""
    flag = getattr(router, "norm_topk_prob", None)
    rule = softmax_topk_rule(p_NX, w_NK, own_NK, own_NK.shape[1], (flag, True, False) if isinstance(flag, bool)
                             else (True, False))
    if rule is not None:
        return rule
    raise ValueError(f"routing replay: layer {li}'s router {type(router).__name__} does not weight a plain top-k of the "
                     "softmax of its logits (a grouped, biased or sigmoid router): replay could not recompute its weights")


def pad_routes(routes: Sequence[torch.Tensor | None], T: int, M: int, K: int) -> torch.Tensor:
    """Per-sequence routes ([<= T, M, K] or None) as one right-padded [B, T, M, K] tensor, -1 where unknown."""
    out = torch.full((len(routes), T, M, K), -1, dtype=_ROUTE_DTYPE)
    for b, r in enumerate(routes):
        if r is not None and len(r):
            n = min(T, r.shape[0])
            out[b, :n] = r[:n]
    return out
