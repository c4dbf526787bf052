"""The EAGLE-3 draft as the embedded engine's drafter (SPEC §6.2): ``Eagle3Drafter`` implements
`k3post.rollout.speculative.Drafter` with an `Eagle3Draft`, in the inference form of ``unrolled_logits``.

Per request it keeps the draft's own KV in a slot of a ``SlotKVCache`` (one slot per live request, bound to
the engine's batch size and length): one step-0 entry per context position t, the midlayer's key / value of
[embed(x_{t+1}) ; fc(features_t)] at RoPE position t, and the entry's pre-norm output out_t. With a context
x_0 … x_{n-1} (x_{n-1} pending, so the target has computed features up to t = n-2), a proposal

    adds the entries of the positions P … n-2 it does not hold yet (features from the engine's aux hidden
        states; a causal chunk over the held keys)
    step 0:  q_1 = sampling_probs(lm_head(norm(out_{n-2})))          d_1 ~ q_1
    step j:  h_j = midlayer(embed(d_j), h_{j-1}) at RoPE position n-2+j, its key written at position n-2+j,
             attending to the held entries 0 … n-2 and the drafted keys of steps 1 … j;  q_{j+1} from h_j

which is exactly what ``unrolled_logits`` computes at t = n-2 when its teacher-forced tokens are the drafts.
The drafted keys sit at the positions the next proposal's step-0 entries overwrite (it reads the target's
features of the accepted positions instead); drafted positions past the engine's max_len (never verified)
are clamped into the cache. The midlayer runs lean (``_layer``: fused q/k/v and gate/up weights, the engine's
norm and rotary helpers, attention as two batched GEMMs), equal to ``MidLayer`` up to fp32 rounding.

q is drawn at the request's temperature / top-k / top-p with the engine's own ``sampling_probs``
(temperature 0: one-hot at the argmax), over the target vocabulary with zeros outside a reduced draft
vocabulary; d_j uses ``stream_uniforms(seed, position + j, STREAM_DRAFT)`` like
``ModelDrafter``, so the drafter is a function of its context and the law stays exact.

Layer ids: the engine hands hidden states *after* decoder layer j, i.e. k3post id j + 1 (`k3post.spec.eagle3`);
id 0 (the embeddings) is never recorded by the engine and is refused. A row whose features have a gap (a
resume or a KV import: ``aux_start`` beyond what the drafter holds) is rebuilt from its context with one
target forward (``target_features``) when the drafter was given the ``target``; without it the missing
features are zeros (worse drafts, the same law).

Legend: B rows, K key/value heads, P held positions, T new positions, S keys, D hidden, d head dim,
V target vocabulary, W draft vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from k3post.rollout.embedded.forward import Norm, norm_of, rms, rotate
from k3post.rollout.engine import _inverse_cdf
from k3post.rollout.kv_cache import SlotKVCache
from k3post.rollout.speculative import STREAM_DRAFT, DraftRow, row_sampling_probs, stream_uniforms
from k3post.spec.eagle3 import Eagle3Draft, target_features

log = logging.getLogger("k3post.spec")

__all__ = ["Eagle3Drafter"]


class _Lean(NamedTuple):
    """The draft's weights as the drafter's forward reads them (taken at ``bind``; ``refresh_weights`` after
    training the draft further): the norms as the engine applies them (``_rms``: HF's RMSNorm up to fp32
    rounding, fewer ops), q/k/v fused into one [(H+2K)d, 2D] matrix and the MLP's gate / up into one [2I, D],
    the rotary table of positions 0 … P-1 (cos and sign-folded sin, the engine's ``_rotate``)."""

    in_norm: Norm
    hidden_norm: Norm
    post_norm: Norm
    final_norm: Norm
    qkv: torch.Tensor
    o_proj: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    lm_head: torch.Tensor
    cos_PE: torch.Tensor
    ssin_PE: torch.Tensor


def _lean(draft: Eagle3Draft, positions: int) -> _Lean:
    block = draft.midlayer
    attn, mlp = block.self_attn, block.mlp
    w = draft.fc.weight
    cos_1PE, sin_1PE = block.rotary_emb(w.new_zeros(1, 1, w.shape[0]), torch.arange(positions, device=w.device)[None])
    half = cos_1PE.shape[-1] // 2
    sign_E = torch.cat([-torch.ones(half, dtype=sin_1PE.dtype), torch.ones(half, dtype=sin_1PE.dtype)]).to(w.device)
    return _Lean(norm_of(block.input_layernorm), norm_of(block.hidden_norm), norm_of(block.post_attention_layernorm),
                 norm_of(draft.norm), torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                 attn.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight,
                 draft.lm_head.weight, cos_1PE[0], sin_1PE[0] * sign_E)


class Eagle3Drafter:
    """`Drafter` over an `Eagle3Draft` (module docstring); ``target`` (optional) rebuilds rows with a feature gap."""

    def __init__(self, draft: Eagle3Draft, target: nn.Module | None = None) -> None:
        ids = draft.config.aux_layer_ids
        if 0 in ids:
            raise ValueError(f"Eagle3Drafter: aux layer id 0 (the embeddings) is not recorded by the engine, which "
                             f"hands hidden states after decoder layers only; use ids in 1..L, got {ids}")
        self.draft = draft.eval()
        self.target = target
        self.aux_layers: tuple[int, ...] = tuple(i - 1 for i in ids)
        self._vocab = 0
        self._max_len = 0
        self._w: _Lean | None = None
        self._cache: SlotKVCache | None = None
        self._out_SPD: torch.Tensor | None = None  # pre-norm output of each held entry, per slot
        self._slot: dict[str, int] = {}
        self._ids: dict[str, list[int]] = {}  # the context the slot's entries were built from
        self._held: dict[str, int] = {}  # step-0 entries held: positions 0 … held-1
        self._free: list[int] = []
        self.forwards = 0  # draft forwards (the context chunk and each drafted step count one)
        self.rebuilds = 0  # rows whose features were recomputed with the target
        self.zero_filled = 0  # context positions drafted from zero features (a gap and no target to fill it)

    def bind(self, max_sequences: int, max_len: int, vocab_size: int) -> None:
        if int(self.draft.target_ids.max()) >= vocab_size:
            raise ValueError(f"Eagle3Drafter: the draft vocabulary maps to target ids up to "
                             f"{int(self.draft.target_ids.max())}, beyond the target's {vocab_size}")
        block, w = self.draft.midlayer, self.draft.fc.weight
        self._vocab, self._max_len = vocab_size, max_len
        self._cache = SlotKVCache(1, max_sequences, block.n_kv, block.head_dim, max_len=max_len, dtype=w.dtype,
                                  device=w.device)
        self._out_SPD = w.new_zeros(max_sequences, max_len, w.shape[0])
        self._free = list(range(max_sequences - 1, -1, -1))
        self._slot.clear()
        self._ids.clear()
        self._held.clear()
        self.refresh_weights()

    def refresh_weights(self) -> None:
        """Re-read the draft's weights (after training it further while bound)."""
        with torch.no_grad():
            self._w = _lean(self.draft, self._max_len)

    def rollback(self, key: str, num_tokens: int) -> None:
        ids = self._ids.get(key)
        if ids is not None:
            del ids[num_tokens:]
            self._held[key] = min(self._held[key], max(0, num_tokens - 1))

    def release(self, key: str) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            del self._ids[key], self._held[key]

    # ------------------------------------------------------------------ the midlayer, lean
    def _layer(self, tok_BT: torch.Tensor, hidden_BTD: torch.Tensor, pos_BT: torch.Tensor, slots_B: torch.Tensor
               ) -> torch.Tensor:
        """The midlayer on T new positions per row (module docstring's math; HF's up to fp32 rounding): writes
        their keys / values into the rows' slots at ``pos_BT`` and attends to each slot's positions <= the
        query's (softmax(q K^T / sqrt(d)) V as two batched GEMMs, the g = H/K query heads of a kv head as
        rows of one GEMM). Returns the pre-norm out_BTD."""
        w, cache, block = self._w, self._cache, self.draft.midlayer
        assert w is not None and cache is not None
        B, T, _ = hidden_BTD.shape
        H, K, d = block.n_heads, block.n_kv, block.head_dim
        g = H // K
        x_BT2D = torch.cat([rms(self.draft.embed_tokens(tok_BT), w.in_norm, False),
                            rms(hidden_BTD, w.hidden_norm, False)], dim=-1)
        qkv_BTF = F.linear(x_BT2D, w.qkv)
        qk_BTNE = rotate(qkv_BTF[..., : (H + K) * d].view(B, T, H + K, d), w.cos_PE[pos_BT][:, :, None],
                          w.ssin_PE[pos_BT][:, :, None], False)
        L = int(pos_BT.max()) + 1
        cache.ensure_capacity(L)
        cache.write_step(0, cache.step_index(pos_BT, slots_B), qk_BTNE[:, :, H:],
                         qkv_BTF[..., (H + K) * d:].reshape(B, T, K, d))
        k_BKLd, v_BKLd = cache.gather(0, slots_B.tolist(), L)
        q_BKRd = qk_BTNE[:, :, :H].reshape(B, T, K, g, d).permute(0, 2, 3, 1, 4).reshape(B, K, g * T, d)
        keep_B11TL = (torch.arange(L, device=pos_BT.device)[None, None, :] <= pos_BT[:, :, None])[:, None, None]
        s_BKgTL = torch.matmul(q_BKRd, k_BKLd.transpose(-1, -2)).view(B, K, g, T, L).mul_(d ** -0.5)
        s_BKgTL.masked_fill_(~keep_B11TL, float("-inf"))
        o_BKRd = torch.matmul(torch.softmax(s_BKgTL, dim=-1).view(B, K, g * T, L), v_BKLd)
        o_BTF = o_BKRd.view(B, K, g, T, d).permute(0, 3, 1, 2, 4).reshape(B, T, H * d)
        h_BTD = hidden_BTD + F.linear(o_BTF, w.o_proj)
        gate_up = F.linear(rms(h_BTD, w.post_norm, False), w.gate_up)
        I = gate_up.shape[-1] // 2
        return h_BTD + F.linear(F.silu(gate_up[..., :I]) * gate_up[..., I:], w.down)

    def _q(self, out_BD: torch.Tensor, rows: Sequence[DraftRow]) -> torch.Tensor:
        """q_BV (float64, on the CPU) of pre-norm outputs: the head's logits over the draft vocabulary,
        -inf elsewhere, at each row's sampling parameters."""
        w = self._w
        assert w is not None
        logits_BW = F.linear(rms(out_BD, w.final_norm, False), w.lm_head)
        if logits_BW.shape[-1] == self._vocab:  # the full vocabulary: draft id = target id
            logits_BV = logits_BW
        else:
            logits_BV = logits_BW.new_full((len(rows), self._vocab), float("-inf"))
            logits_BV[:, self.draft.target_ids] = logits_BW
        return row_sampling_probs(logits_BV[:, None], [r.sampling for r in rows])[:, 0].cpu()

    # ------------------------------------------------------------------ features of the new positions
    def _features(self, r: DraftRow, lo: int, hi: int) -> torch.Tensor:
        """Fused [h_low ; h_mid ; h_high] of context positions lo … hi-1: [hi-lo, 3D] in the draft's dtype."""
        w = self.draft.fc.weight
        fused_T3D = torch.zeros(hi - lo, w.shape[1], dtype=w.dtype, device=w.device)
        have = torch.zeros(hi - lo, dtype=torch.bool)
        if r.aux_hidden is not None and len(r.aux_hidden):
            a, b = max(lo, r.aux_start), min(hi, r.aux_start + len(r.aux_hidden))
            if a < b:
                rows_NAD = r.aux_hidden[a - r.aux_start: b - r.aux_start]
                fused_T3D[a - lo: b - lo] = rows_NAD.reshape(len(rows_NAD), -1).to(w.device, w.dtype)
                have[a - lo: b - lo] = True
        if not bool(have.all()) and self.target is not None:
            ids_1T = torch.tensor([list(r.context[:hi])], device=next(self.target.parameters()).device)
            fused_1T3D, _ = target_features(self.target, ids_1T, self.draft.config.aux_layer_ids)
            fused_T3D = fused_1T3D[0, lo:hi].to(w.device, w.dtype)
            self.rebuilds += 1
        elif not bool(have.all()):
            missing = int((~have).sum())
            if not self.zero_filled:  # a weaker draft is never chosen silently
                log.warning("Eagle3Drafter: %d context position(s) of request %r have no target hidden states (a KV "
                            "import or resume) and no target= to recompute them: they are zeros, so drafts are worse "
                            "(the output distribution is unchanged); pass Eagle3Drafter(draft, target=...)",
                            missing, r.key)
            self.zero_filled += missing
        return fused_T3D

    # ------------------------------------------------------------------ the proposal
    def propose(self, rows: Sequence[DraftRow], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None:
            raise ValueError("Eagle3Drafter.propose before bind (pass it to EmbeddedEngine through SpeculativeConfig)")
        with torch.inference_mode():
            return self._propose(rows, k)

    def _propose(self, rows: Sequence[DraftRow], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        draft, out_SPD = self.draft, self._out_SPD
        assert out_SPD is not None
        dev = draft.fc.weight.device
        B, V, top = len(rows), self._vocab, self._max_len - 1
        held, new = [], []  # new: (tokens, features) of each row's positions held … n-2
        for r in rows:
            n = len(r.context)
            if n < 2:
                raise ValueError(f"Eagle3Drafter: request {r.key!r} has a context of {n} token; EAGLE-3 drafts from "
                                 "the target's features of the position before the pending token (>= 2 tokens)")
            if r.key not in self._slot:
                if not self._free:
                    raise ValueError(f"Eagle3Drafter: more live requests than the {len(self._slot)} it was bound for")
                self._slot[r.key], self._ids[r.key], self._held[r.key] = self._free.pop(), [], 0
            ids = self._ids[r.key]
            same = 0  # entry t stays valid while ids[0 .. t+1] are still the context
            while same < min(len(ids), n) and ids[same] == r.context[same]:
                same += 1
            P = min(self._held[r.key], max(0, same - 1), n - 1)
            self._ids[r.key], self._held[r.key] = list(r.context), n - 1
            held.append(P)
            new.append((list(r.context[P + 1: n]), self._features(r, P, n - 1)))
        slots_B = torch.tensor([self._slot[r.key] for r in rows], dtype=torch.long, device=dev)
        n_T = [len(t) for t, _ in new]
        T = max(n_T)
        last_BD = out_SPD[slots_B, torch.tensor([max(0, P - 1) for P in held], device=dev)]
        if T:  # step-0 entries of the new positions: one causal chunk over the held keys
            tok_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
            fused_BT3D = draft.fc.weight.new_zeros(B, T, draft.fc.weight.shape[1])
            for b, (tok, fused) in enumerate(new):
                tok_BT[b, : n_T[b]] = torch.tensor(tok, dtype=torch.long)
                fused_BT3D[b, : n_T[b]] = fused
            # padded positions (past a row's n-2) are scratch, overwritten before they are read
            pos_BT = (torch.tensor(held, device=dev)[:, None] + torch.arange(T, device=dev)).clamp_(max=top)
            out_BTD = self._layer(tok_BT, draft.fc(fused_BT3D), pos_BT, slots_B)
            self.forwards += 1
            for b, (P, m) in enumerate(zip(held, n_T)):
                if m:
                    out_SPD[slots_B[b], P: P + m] = out_BTD[b, :m]
                    last_BD[b] = out_BTD[b, m - 1]
        # drafting: step 0 from out_{n-2}, then steps 1 … k-1, step j's key at position n-2+j (the positions
        # the next round's step-0 entries overwrite); positions past the engine's length are clamped (those
        # drafts are never verified)
        pos_B = torch.tensor([len(r.context) - 1 for r in rows], device=dev)
        seeds = [r.seed for r in rows]
        draft_BK = torch.zeros(B, k, dtype=torch.long)
        q_BKV = torch.zeros(B, k, V, dtype=torch.float64)
        h_BD = last_BD
        for j in range(k):
            q_BV = self._q(h_BD, rows)
            d_B = _inverse_cdf(torch.cumsum(q_BV, dim=-1), stream_uniforms(seeds, [r.position + j for r in rows],
                                                                           STREAM_DRAFT))
            q_BKV[:, j] = q_BV
            draft_BK[:, j] = d_B
            if j == k - 1:
                break
            h_BD = self._layer(d_B.to(dev)[:, None], h_BD[:, None], (pos_B + j).clamp(max=top)[:, None], slots_B)[:, 0]
            self.forwards += 1
        return draft_BK, q_BKV
