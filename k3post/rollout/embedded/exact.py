"""The exact forward (``rl.rollout.exact``): a forward whose logits for a position carry the same bits whatever else
shares the forward, so the engine's behaviour log-probs equal the trainer's recomputed ones bit for bit, under any
batch composition, prefix sharing, pause / resume or server (issue 35; docs/decisions.md §exactmode).

Ordinary forwards are not batch-invariant on CPU: a GEMM picks its kernel by the number of rows (1-3 rows take
another one than 4 or more, §exactprobe), attention over L keys reduces in an order that depends on L, the
routed experts run as GEMMs over however many tokens chose them. The exact forward keeps to the ops that
`bench/row_invariance.py` finds row-invariant and gives every other reduction a fixed shape:

    GEMMs       every projection (q/k/v, o, router, each expert's gate/up and down, lm_head) runs on fixed
                tiles of ``TILE`` = 16 rows, the last tile padded with zeros, as one ``bmm`` over the tiles
                (`tiled_mm`): a row's result does not depend on its neighbours or its place in a tile;
    attention   keys in fixed blocks of ``KEY_BLOCK`` = 64 absolute positions; per (16-query tile, key block)
                one ``bmm`` for the scores and one for p·V; the row max (exact in any order), exp, per-block
                sums over 64 keys, then the blocks added in key order by a cumulative sum (`exact_attention`).
                A block past a query's position adds exact zeros, so the number of blocks in a forward (the
                longest row of a decode batch, the trainer's sequence length) does not change a bit;
    experts     each token's top-k experts run per expert on tiled GEMMs, the weighted outputs added to the
                residual in top-k rank order;
    per row     embedding, RMSNorm (``F.rms_norm``), rotary (mul, mul, add), SiLU, MX fake quantization
                (blocks along the last dim), softmax / top-k of the router, log-softmax.

One forward serves both sides. The engine (`EmbeddedEngine(exact=True)`) runs it over its slot KV cache for
prefills, decode steps and speculative verification (``forward_chunks``); the trainer runs it over whole
sequences (``token_logprobs``) for the values of its log-probs, while their gradient comes from the model's own
forward (`k3post.policy_step`): ``logp = exact.detach() + (hf − hf.detach())`` has the exact values and the
model's gradient.

Fail-closed: another BLAS or thread count may tile differently, so `check_batch_invariance` runs once per
(model shape, threads) before the first use and raises when any composition differs by a bit; the trainer raises
when a token the trained weights sampled has any gap (`k3post.policy_step`).

Scope: float32 Llama-style decoders the lean forward mirrors (``lean_blocker``), with routed experts behind a
plain top-k router or a plain gated MLP; anything else is a ValueError naming why.

Shape legend: as `k3post.rollout.embedded.forward`; besides
    M   query rows of one (sequence, kv head): its T positions × R query heads, padded to whole tiles
    Q   16-row query tiles,  C  64-key blocks
"""

from __future__ import annotations

import threading
from itertools import groupby
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from k3post.quant import qat as qat_module
from k3post.rollout.embedded.forward import (LeanForward, WeightPlan, _MoEWeights, expert_act, fake_quant_act, lean_blocker,
                                             rms, rotate, topk_router_rule)

__all__ = ["KEY_BLOCK", "QUERY_TILE", "TILE", "ExactForward", "check_batch_invariance", "exact_attention", "exact_blocker",
           "exact_forward_for", "tiled_mm"]

TILE = 16  # GEMM rows per tile
KEY_BLOCK = 64  # attention keys per block
QUERY_TILE = 16  # attention query rows per tile
DENSE_MOE_TOKENS = 64  # forwards of at most this many tokens run every expert on every token
_MAX_TILES = 512  # attention tiles per bmm call (bounds the trainer's score memory; results do not depend on it)


def tiled_mm(x_NJ: torch.Tensor, b_JO: torch.Tensor) -> torch.Tensor:
    """x @ b on fixed tiles of ``TILE`` rows (the last padded with zeros), one ``bmm`` over the tiles: row n of
    the result carries the same bits whatever rows share the call (``b`` is the same tensor, same strides)."""
    N, J = x_NJ.shape
    if N == 0:
        return x_NJ.new_zeros(0, b_JO.shape[1])
    pad = (-N) % TILE
    xp_NJ = torch.cat([x_NJ, x_NJ.new_zeros(pad, J)]) if pad else x_NJ.contiguous()
    n = xp_NJ.shape[0] // TILE
    return torch.bmm(xp_NJ.view(n, TILE, J), b_JO.expand(n, *b_JO.shape)).view(n * TILE, -1)[:N]


def _linear(x_NJ: torch.Tensor, w_OJ: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
    y_NO = tiled_mm(x_NJ, w_OJ.t())
    return y_NO if b_O is None else y_NO + b_O


def _pad_rows(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t`` with ``n`` zero rows appended along ``dim`` (``t`` itself when n is 0: no copy)."""
    if not n:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:dim], n, *t.shape[dim + 1:])], dim=dim)


def exact_attention(q_BHTE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor, qpos_BT: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """softmax(q K^T · scaling, keys 0..qpos) V per query, o [B, T, H*E], batch-invariant (module doc): query head h
    reads kv head h // (H / G); key l of row b is K[b, :, l]; a query at position p attends to keys 0..p. Keys
    past a row's valid length must be finite (their weight is an exact zero; their scores may be anything).

    Query tiles of ``QUERY_TILE`` rows read only the key blocks up to their last position (the causal triangle of
    a whole sequence: half the work of every block for long ones): a block past every query of a tile would add
    exact zeros, so leaving it out changes no bit."""
    B, H, T, E = q_BHTE.shape
    G, L = k_BGLE.shape[1], k_BGLE.shape[2]
    R, QT, KB = H // G, QUERY_TILE, KEY_BLOCK
    M = T * R
    Mp = -(-M // QT) * QT
    Lp = -(-L // KB) * KB
    Q, X = Mp // QT, B * G
    dev = q_BHTE.device
    # query rows of each (row, kv head): position-major, the R heads of the kv head within a position
    q_XME = _pad_rows(q_BHTE.reshape(B, G, R, T, E).transpose(2, 3).reshape(X, M, E), Mp - M, 1)
    qpos_XM = qpos_BT.repeat_interleave(R, dim=1).repeat_interleave(G, dim=0)
    qpos_XQr = _pad_rows(qpos_XM, Mp - M, 1).view(X, Q, QT)  # padded rows attend to key 0 (finite, discarded)
    kt_XCKE = _pad_rows(k_BGLE.reshape(X, L, E), Lp - L, 1).view(X, Lp // KB, KB, E)
    vt_XCKE = _pad_rows(v_BGLE.reshape(X, L, E), Lp - L, 1).view(X, Lp // KB, KB, E)
    kpos_CK = torch.arange(Lp, device=dev).view(-1, KB)
    neg_inf = torch.full((), float("-inf"), dtype=q_BHTE.dtype, device=dev)
    out_XQrE = q_XME.new_empty(X, Q, QT, E)
    # the softmax runs on the real rows only when one tile holds them all (a decode step: R of QT rows); elementwise
    # ops and reductions over a block's keys give a row the same bits either way (whole 64-key rows: no scalar tail)
    rows = M if Q == 1 else QT
    # the key blocks each query tile reads (its last position's block and those before), over runs of equal count
    need_Q = (qpos_XQr.amax(dim=(0, 2)) // KB + 1).tolist()
    qb = 0
    for C, run in groupby(need_Q):  # query tiles qa..qb-1 read key blocks 0..C-1
        qa, qb = qb, qb + len(list(run))
        # chunks of (row, tile) pairs: a bmm's per-entry result does not depend on how many entries it holds
        q_step = max(1, min(qb - qa, _MAX_TILES // C))
        x_step = max(1, _MAX_TILES // (C * q_step))
        for x0 in range(0, X, x_step):
            xs = slice(x0, min(X, x0 + x_step))
            for q0 in range(qa, qb, q_step):
                qs = slice(q0, min(qb, q0 + q_step))
                qt_xqrE = q_XME.view(X, Q, QT, E)[xs, qs]
                n_x, n_q = qt_xqrE.shape[0], qt_xqrE.shape[1]
                kt_x1CKE, vt_x1CKE = kt_XCKE[xs, None, :C], vt_XCKE[xs, None, :C]
                s_NrK = torch.bmm(qt_xqrE[:, :, None].expand(n_x, n_q, C, QT, E).reshape(-1, QT, E),
                                  kt_x1CKE.expand(n_x, n_q, C, KB, E).reshape(-1, KB, E).transpose(1, 2))
                keep_xqCrK = kpos_CK[:C, None, :] <= qpos_XQr[xs, qs, None, :rows, None]
                s_xqCrK = torch.where(keep_xqCrK, s_NrK.view(n_x, n_q, C, QT, KB)[..., :rows, :] * scaling, neg_inf)
                m_xq1r1 = s_xqCrK.amax(dim=(2, 4), keepdim=True)  # exact in any order
                e_xqCrK = torch.exp(s_xqCrK - m_xq1r1)
                z_xqCr = e_xqCrK.sum(-1)  # over one block's 64 keys
                e_xqCrK = _pad_rows(e_xqCrK, QT - rows, 3)
                pv_xqCrE = torch.bmm(e_xqCrK.reshape(-1, QT, KB),
                                     vt_x1CKE.expand(n_x, n_q, C, KB, E).reshape(-1, KB, E)).view(n_x, n_q, C, QT, E)
                # blocks in key order (a cumulative sum is sequential; blocks past a query add exact zeros)
                z_xqr = z_xqCr.cumsum(2)[:, :, -1]
                pv_xqrE = pv_xqCrE[..., :rows, :].cumsum(2)[:, :, -1]
                out_XQrE[xs, qs, :rows] = pv_xqrE / z_xqr[..., None]
    o_XME = out_XQrE.view(X, Mp, E)[:, :M]
    return o_XME.view(B, G, T, R, E).permute(0, 2, 1, 3, 4).reshape(B, T, H * E)


def _plain_gated_mlp(mlp: nn.Module) -> bool:
    """A Llama-style MLP: ``down(act(gate(x)) * up(x))`` with three bias-free nn.Linear and a plain activation."""
    return set(dict(mlp.named_children())) <= {"gate_proj", "up_proj", "down_proj", "act_fn"} and all(
        type(getattr(mlp, a, None)) is nn.Linear and getattr(mlp, a).bias is None for a in ("gate_proj", "up_proj", "down_proj")
    ) and callable(getattr(mlp, "act_fn", None)) and type(mlp).__name__.endswith("MLP")


def exact_blocker(model: Any, max_model_len: int) -> str | None:
    """Why the exact forward cannot run ``model`` (None when it can): the lean forward's conditions
    (``lean_blocker``), float32 weights, and every layer's MLP either routed experts behind a plain top-k router
    (the dense-MoE layout) or a plain gated MLP."""
    why = lean_blocker(model, max_model_len)
    if why is not None:
        return why
    param = next(model.parameters())
    if param.dtype != torch.float32:
        return f"the exact forward runs float32 models; this one is {param.dtype}"
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if LeanForward._dense_moe_eligible(mlp):
            X, D, _ = mlp.experts.down_proj.shape
            if topk_router_rule(mlp.gate, X, D) is None:
                return f"layer {i}'s router is not a plain softmax top-k router"
        elif not _plain_gated_mlp(mlp):
            return f"layer {i}'s MLP ({type(mlp).__name__}) is neither plain routed experts nor a plain gated MLP"
    return None


class ExactForward(LeanForward):
    """The exact forward over ``model`` (module doc), with a slot KV cache of ``num_slots`` rows of up to
    ``max_len`` positions: the `LeanForward` surface the engine uses (``cache``, ``forward_chunks``,
    ``capture_layers`` / ``captured``, ``routes``) and ``token_logprobs`` for the trainer. ValueError when
    `exact_blocker` finds a reason; RuntimeError when `check_batch_invariance` fails (``check``)."""

    _always_exact = True  # the weight plan keeps HF's layouts and forms (F.rms_norm, mul-mul-add rotary)

    def __init__(self, model: Any, num_slots: int, max_len: int, *, check: bool = True) -> None:
        why = exact_blocker(model, max_len)
        if why is not None:
            raise ValueError(f"rl.rollout.exact: the exact forward cannot run {type(model).__name__}: {why}")
        super().__init__(model, num_slots, max_len, qat_op_order="hf", dense_moe_max_tokens=0)
        if check:
            check_batch_invariance(model)

    # ---- one layer -------------------------------------------------------------------------------------------

    def _moe(self, m: _MoEWeights, h_ND: torch.Tensor, x_ND: torch.Tensor, li: int) -> torch.Tensor:
        """x + the routed experts of h: softmax top-k routing (renormalised when the router does), each expert on
        the tokens that chose it (tiled GEMMs), the weighted outputs added in top-k rank order."""
        N, D = h_ND.shape
        I, K = m.width, m.top_k
        assert m.router is not None and m.up is not None
        w_NK, e_NK = torch.topk(torch.softmax(_linear(h_ND, m.router.w), dim=-1, dtype=torch.float), K, dim=-1)
        if m.norm_topk:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        w_NK = w_NK.to(h_ND.dtype)
        if self.routes is not None:
            self.routes.record(li, e_NK)
        hq_ND = h_ND if m.qat is None else fake_quant_act(h_ND, m.qat.activation_format, m.qat.block_size)
        up_w, down_w = m.up.w, m.down_w
        if N <= DENSE_MOE_TOKENS:  # few tokens (a decode step): every expert on every token, as one bmm per GEMM
            y_XND = self._all_experts(m, hq_ND)
            y_NKD = y_XND[e_NK, torch.arange(N, device=h_ND.device)[:, None]]
            return self._combine(x_ND, w_NK, y_NKD)
        y_NKD = h_ND.new_zeros(N, K, D)
        for x in torch.unique(e_NK).tolist():
            n_idx, k_idx = (e_NK == x).nonzero(as_tuple=True)
            a_nI = expert_act(m, _linear(hq_ND[n_idx], up_w[x * 2 * I : (x + 1) * 2 * I]))
            y_NKD[n_idx, k_idx] = tiled_mm(a_nI, down_w[x * I : (x + 1) * I])
        return self._combine(x_ND, w_NK, y_NKD)

    @staticmethod
    def _combine(x_ND: torch.Tensor, w_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
        """x + sum_k w_nk y_nk, added in top-k rank order."""
        out_ND = x_ND
        for k in range(w_NK.shape[1]):
            out_ND = out_ND + w_NK[:, k, None] * y_NKD[:, k]
        return out_ND

    @staticmethod
    def _all_experts(m: _MoEWeights, hq_ND: torch.Tensor) -> torch.Tensor:
        """Every expert's output on every token, [X, N, D]: one ``bmm`` over (expert, 16-row tile) entries per GEMM,
        each entry the shape and operand layout `tiled_mm` gives the same rows when an expert runs on the tokens
        that chose it (so a token's output does not depend on which path ran it; `check_batch_invariance`)."""
        assert m.up is not None
        N, D = hq_ND.shape
        X, I = m.n_experts, m.width
        n = -(-N // TILE)
        h_nTD = F.pad(hq_ND, (0, 0, 0, n * TILE - N)).view(1, n, TILE, D).expand(X, n, TILE, D).reshape(X * n, TILE, D)
        up_nD2I = m.up.w.view(X, 1, 2 * I, D).expand(X, n, 2 * I, D).reshape(X * n, 2 * I, D).transpose(1, 2)
        a_nTI = expert_act(m, torch.bmm(h_nTD, up_nD2I))
        down_nID = m.down_w.view(X, 1, I, D).expand(X, n, I, D).reshape(X * n, I, D)
        return torch.bmm(a_nTI, down_nID).view(X, n * TILE, D)[:, :N]

    def _dense(self, li: int, h_ND: torch.Tensor, x_ND: torch.Tensor) -> torch.Tensor:
        mlp: Any = self._layers[li].mlp
        a_NI = mlp.act_fn(_linear(h_ND, mlp.gate_proj.weight)) * _linear(h_ND, mlp.up_proj.weight)
        return x_ND + _linear(a_NI, mlp.down_proj.weight)

    def _layers_forward(self, w: WeightPlan, x_ND: torch.Tensor, B: int, T: int, qpos_BT: torch.Tensor,
                        kv: Any) -> torch.Tensor:
        """The decoder layers over N = B*T rows at positions qpos_BT; ``kv(li, k_BGTE, v_BGTE)`` returns the keys
        and values the rows attend to, [B, G, L, E] (the engine writes its cache and reads the slots back)."""
        H, G, E = self._n_heads, self._n_kv, self._head_dim
        N = B * T
        cos_N1E, sin_N1E = self._rotary(qpos_BT.reshape(N))
        aux: dict[int, torch.Tensor] = {}
        for li, lw in enumerate(w.layers):
            assert lw.o_proj is not None
            qkv_NF = _linear(rms(x_ND, lw.in_norm, True), lw.qkv.w, lw.qkv.b)
            qk_NME = qkv_NF[:, : (H + G) * E].reshape(N, H + G, E)
            if lw.qk_norm is not None:
                qk_NME = rms(qk_NME, lw.qk_norm, True)
            qk_NME = rotate(qk_NME, cos_N1E, sin_N1E, True)
            q_BHTE = qk_NME[:, :H].reshape(B, T, H, E).transpose(1, 2)
            k_BGTE = qk_NME[:, H:].reshape(B, T, G, E).transpose(1, 2)
            v_BGTE = qkv_NF[:, (H + G) * E :].reshape(B, T, G, E).transpose(1, 2)
            k_BGLE, v_BGLE = kv(li, k_BGTE, v_BGTE)
            o_NF = exact_attention(q_BHTE, k_BGLE, v_BGLE, qpos_BT, self.scaling).reshape(N, H * E)
            x_ND = x_ND + _linear(o_NF, lw.o_proj.w, lw.o_proj.b)
            h_ND = rms(x_ND, lw.post_norm, True)
            x_ND = self._dense(li, h_ND, x_ND) if lw.moe is None else self._moe(lw.moe, h_ND, x_ND, li)
            if li in self.capture_layers:
                aux[li] = x_ND.view(B, T, -1)
        if self.capture_layers:
            self.captured = torch.stack([aux[i] for i in self.capture_layers], dim=2)
        return x_ND

    def _head(self, w: WeightPlan, x_ND: torch.Tensor) -> torch.Tensor:
        assert w.lm_head is not None
        return _linear(rms(x_ND, w.final_norm, True), w.lm_head.w, w.lm_head.b)

    def _embed_rows(self, w: WeightPlan, ids_N: torch.Tensor) -> torch.Tensor:
        if w.embed is None:
            raise ValueError("rl.rollout.exact: the model's input embedding is not a plain nn.Embedding")
        return F.embedding(ids_N, w.embed)

    # ---- the engine's surface ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_chunks(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], *, logits: bool = True,
        all_positions: bool = False,
    ) -> torch.Tensor | None:
        """`LeanForward.forward_chunks`, exactly (module doc): row b feeds ``chunks[b]`` at positions starts[b]..
        of the sequence in slot slots[b]; decode steps are chunks of one token."""
        B, dev = len(chunks), self.device
        lens, T, L, ids_BT, t_T, valid_BT, start_B = self._chunk_inputs(chunks, starts)
        end_B = start_B + torch.tensor(lens, device=dev)
        qpos_BT = torch.minimum(start_B[:, None] + t_T[None, :], end_B[:, None] - 1)  # padding repeats the last position
        # the keys of whole 64-key blocks where the cache holds them (no padded copy): positions past a row's length
        # hold zeros or another sequence's entries, finite values their exactly-0 weights cancel
        Lk = min(-(-L // KEY_BLOCK) * KEY_BLOCK, self.cache.capacity)
        index_NG = self.cache.step_index(start_B, torch.tensor(slots, device=dev)) if T == 1 else None

        def kv(li: int, k_BGTE: torch.Tensor, v_BGTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if index_NG is not None:  # a decode step: one indexed write per layer
                self.cache.write_step(li, index_NG, k_BGTE[:, :, 0], v_BGTE[:, :, 0])
            else:
                for b in range(B):
                    self.cache.write_block(li, slots[b], starts[b], k_BGTE[b, :, : lens[b]], v_BGTE[b, :, : lens[b]])
            return self.cache.gather(li, slots, Lk)

        w = self.weights()
        x_ND = self._embed_rows(w, ids_BT.view(-1))
        with self._recording(torch.tensor(slots, device=dev).repeat_interleave(T), qpos_BT.reshape(-1), valid_BT.view(-1)):
            x_ND = self._layers_forward(w, x_ND, B, T, qpos_BT, kv)
        if not logits:
            return None
        x_BTD = x_ND.view(B, T, -1)
        if all_positions:
            return self._head(w, x_BTD.reshape(B * T, -1)).view(B, T, -1)
        last_B = torch.tensor([n - 1 for n in lens], dtype=torch.long, device=dev)
        return self._head(w, x_BTD[torch.arange(B, device=dev), last_B])

    # ---- the trainer's surface -----------------------------------------------------------------------------

    @torch.no_grad()
    def hidden(self, ids_BT: torch.Tensor, prefix_len: int = 0) -> torch.Tensor:
        """The last layer's hidden states of whole right-padded sequences (position t attends to 0..t; no cache):
        [B, T, D], or with ``prefix_len`` P ≥ 1, when every row starts with the same P tokens, [B, T - P + 1, D] of
        positions P - 1 .. T - 1: the prefix runs once (one row) and its keys and values serve every row, as the
        engine's prefix sharing does (the same bits: a row's keys and values do not depend on the rows beside it)."""
        B, T = ids_BT.shape
        P = int(prefix_len)
        if T > self.max_model_len:
            raise ValueError(f"rl.rollout.exact: a sequence of {T} tokens is longer than the exact forward's {self.max_model_len}")
        if not 0 <= P < T:
            raise ValueError(f"prefix_len must be in [0, {T}), got {P}")
        ids_BT = ids_BT.to(self.device)
        pos_T = torch.arange(T, device=self.device)
        w = self.weights()
        if not P:
            x_ND = self._layers_forward(w, self._embed_rows(w, ids_BT.reshape(-1)), B, T, pos_T.expand(B, T),
                                        lambda li, k, v: (k, v))
            return x_ND.view(B, T, -1)
        kv_P: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(li: int, k_1GPE: torch.Tensor, v_1GPE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kv_P[li] = (k_1GPE, v_1GPE)
            return k_1GPE, v_1GPE

        def join(li: int, k_BGSE: torch.Tensor, v_BGSE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_1GPE, v_1GPE = kv_P[li]
            return (torch.cat([k_1GPE.expand(B, -1, -1, -1), k_BGSE], dim=2),
                    torch.cat([v_1GPE.expand(B, -1, -1, -1), v_BGSE], dim=2))

        x_PD = self._layers_forward(w, self._embed_rows(w, ids_BT[0, :P]), 1, P, pos_T[None, :P], keep)
        x_ND = self._layers_forward(w, self._embed_rows(w, ids_BT[:, P:].reshape(-1)), B, T - P,
                                    pos_T[None, P:].expand(B, T - P), join)
        D = x_ND.shape[-1]
        return torch.cat([x_PD[-1:].expand(B, D)[:, None], x_ND.view(B, T - P, D)], dim=1)

    @torch.no_grad()
    def logits(self, ids_BT: torch.Tensor, prefix_len: int = 0) -> torch.Tensor:
        """The logits of `hidden`'s positions: [B, T, V], or [B, T - P + 1, V] with ``prefix_len`` P."""
        h_BSD = self.hidden(ids_BT, prefix_len)
        B, S, D = h_BSD.shape
        return self._head(self.weights(), h_BSD.reshape(B * S, D)).view(B, S, -1)

    @torch.no_grad()
    def token_logprobs(self, ids_BT: torch.Tensor, prefix_len: int = 0,
                       mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """``logp[:, t] = log p(ids[:, t] | ids[:, <t])`` for t ≥ 1, 0 at t = 0, float32 without autograd: the
        values the engine recorded when it sampled those tokens with these weights, bit for bit. With
        ``prefix_len`` P (every row starts with the same P tokens; `hidden`) only t ≥ P are computed; with ``mask_BT``
        only where it is True (the lm_head and the log-softmax run on those rows alone); 0 elsewhere."""
        B, T = ids_BT.shape
        P = int(prefix_len)
        h_BSD = self.hidden(ids_BT, P)
        want_BT = torch.zeros(B, T, dtype=torch.bool, device=self.device)
        want_BT[:, max(P, 1):] = True
        if mask_BT is not None:
            want_BT &= mask_BT.to(self.device, torch.bool)
        b_N, t_N = want_BT.nonzero(as_tuple=True)
        ids_BT = ids_BT.to(self.device)
        logits_NV = self._head(self.weights(), h_BSD[b_N, t_N - 1 - max(P - 1, 0)])
        lp_N = torch.log_softmax(logits_NV.float(), dim=-1).gather(-1, ids_BT[b_N, t_N, None]).squeeze(-1)
        out_BT = torch.zeros(B, T, dtype=torch.float32, device=self.device)
        out_BT[b_N, t_N] = lp_N
        return out_BT


_FOR_MODEL: WeakKeyDictionary[nn.Module, ExactForward] = WeakKeyDictionary()
_LOCK = threading.Lock()


def exact_forward_for(model: nn.Module, length: int) -> ExactForward:
    """The trainer's exact forward of ``model`` (one per model, one cache slot), covering sequences of ``length``
    tokens (rebuilt when a longer one comes, to twice the length it had or more: a run's growing sequences rebuild
    it a few times, not once per new longest sequence)."""
    with _LOCK:
        fwd = _FOR_MODEL.get(model)
        if fwd is None or fwd.max_model_len < length:
            size = max(length, 2 * fwd.max_model_len if fwd is not None else 8 * KEY_BLOCK)
            limit = getattr(model.config, "max_position_embeddings", None) or size  # e.g. under a sliding window
            fwd = _FOR_MODEL[model] = ExactForward(model, 1, max(length, min(size, limit)))
        return fwd


_CHECKED: set[tuple[Any, ...]] = set()


def check_batch_invariance(model: nn.Module) -> None:
    """Fail closed (RuntimeError) unless the exact forward gives ``model``'s shapes the same bits in every
    composition that training and rollout produce, on this machine and thread count: three sequences (lengths
    across tiles and key blocks) through the trainer's forward together, one at a time and with a shared prompt
    run once, and through a slot
    cache as an engine runs them: a shared-prefix prefill, chunked prefills and decode steps in batches of
    changing composition. Once per (model shapes, threads) in a process."""
    cfg = model.config
    qat = sorted({repr(getattr(m, qat_module._CFG_ATTR)) for m in model.modules() if hasattr(m, qat_module._CFG_ATTR)})
    key = (type(model).__name__, cfg.to_json_string(use_diff=False), tuple(qat), torch.get_num_threads(), torch.__version__)
    if key in _CHECKED:
        return
    fwd = ExactForward(model, 3, 160, check=False)
    g = torch.Generator().manual_seed(0)
    V = int(model.get_input_embeddings().num_embeddings)
    lens = [150, 71, 9]
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    seqs[1][:20] = seqs[0][:20]  # a shared prefix
    ids_BT = torch.zeros(3, max(lens), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BT[b, : len(s)] = torch.tensor(s)
    ref = fwd.token_logprobs(ids_BT)
    problems: list[str] = []

    def compare(what: str, b: int, positions: range, got: torch.Tensor) -> None:
        want = ref[b, positions.start : positions.stop]
        if not torch.equal(got, want):
            d = (got - want).abs()
            problems.append(f"{what}: sequence {b} positions {positions.start}..{positions.stop - 1} differ by up to "
                            f"{float(d.max()):.3g} (first at {positions.start + int((d > 0).nonzero()[0])})")

    for b, s in enumerate(seqs):  # the trainer's forward, one sequence at a time
        compare("a sequence alone against the batch", b, range(1, len(s)), fwd.token_logprobs(torch.tensor([s]))[0, 1:])
    shared = fwd.token_logprobs(ids_BT[:2], prefix_len=20)  # the trainer's forward of a group sharing its prompt
    for b in range(2):
        compare("a shared prompt run once against the batch", b, range(20, lens[b]), shared[b, 20 : lens[b]])
    mask_BT = torch.rand(ids_BT.shape, generator=g) < 0.3  # the sampled tokens only (the head on those rows)
    some = fwd.token_logprobs(ids_BT, mask_BT=mask_BT)
    for b, s in enumerate(seqs):
        compare("the sampled positions alone against the batch", b, range(1, len(s)),
                torch.where(mask_BT[b, 1 : len(s)], some[b, 1 : len(s)], ref[b, 1 : len(s)]))

    def lp(logits_V: torch.Tensor, tok: int) -> torch.Tensor:
        return torch.log_softmax(logits_V.float(), dim=-1)[tok]

    # an engine: sequence 0 and 1 share their first 20 tokens (one prefill, copied); then chunks and decode steps
    with torch.inference_mode():
        got: list[list[torch.Tensor]] = [[] for _ in seqs]
        out = fwd.forward_chunks([seqs[0][:20]], [0], [0], all_positions=True)
        assert out is not None
        got[0] += [lp(out[0, t], seqs[0][t + 1]) for t in range(20)]
        fwd.cache.copy_slot(0, 1, 20)
        got[1] += [lp(out[0, t], seqs[1][t + 1]) for t in range(20)]
        out = fwd.forward_chunks([seqs[0][20:100], seqs[1][20:33], seqs[2][:5]], [20, 20, 0], [0, 1, 2], all_positions=True)
        assert out is not None
        for b, (a, z) in enumerate(((20, 100), (20, 33), (0, 5))):
            got[b] += [lp(out[b, t - a], seqs[b][t + 1]) for t in range(a, z)]
        pos = [100, 33, 5]
        while any(p < len(s) - 1 for p, s in zip(pos, seqs)):
            rows = [b for b in range(3) if pos[b] < len(seqs[b]) - 1 and (pos[b] + b) % 5]  # compositions change
            rows = rows or [b for b in range(3) if pos[b] < len(seqs[b]) - 1]
            out = fwd.forward_chunks([[seqs[b][pos[b]]] for b in rows], [pos[b] for b in rows], rows)
            assert out is not None
            for i, b in enumerate(rows):
                got[b].append(lp(out[i], seqs[b][pos[b] + 1]))
                pos[b] += 1
    for b, s in enumerate(seqs):
        compare("the engine's prefill, chunks and decode steps against the trainer's forward", b, range(1, len(s)),
                torch.stack(got[b]))
    if problems:
        raise RuntimeError(
            "rl.rollout.exact: the exact forward is not batch-invariant on this machine (torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads): " + "; ".join(problems[:3])
            + ". Run with rl.rollout.exact=false (the default) or 1 thread (run.threads=1)")
    _CHECKED.add(key)
