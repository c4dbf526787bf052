"""The EAGLE-3 draft as the embedded engine's drafter (SPEC §6.2): ``Eagle3Drafter`` implements
`k3post.rollout.speculative.Drafter` with an `Eagle3Draft`, in the inference form of ``unrolled_logits``.

Per request it keeps the draft's own KV: one step-0 entry per context position t, the midlayer's key / value
of [embed(x_{t+1}) ; fc(features_t)] at RoPE position t, and the entry's pre-norm output out_t. With a
context x_0 … x_{n-1} (x_{n-1} pending, so the target has computed features up to t = n-2), a proposal

    adds the entries of the positions P … n-2 it does not hold yet (features from the engine's aux hidden
        states; a causal chunk over the held keys)
    step 0:  q_1 = sampling_probs(lm_head(norm(out_{n-2})))          d_1 ~ q_1
    step j:  h_j = midlayer(embed(d_j), h_{j-1}) at RoPE position n-2+j, attending to the held entries
             0 … n-2 and the drafted keys of steps 1 … j;  q_{j+1} from h_j,  d_{j+1} ~ q_{j+1}

which is exactly what ``unrolled_logits`` computes at t = n-2 when its teacher-forced tokens are the drafts.
The drafted keys are dropped after the proposal: the next one reads the target's features of the accepted
positions instead (its step-0 entries). q is drawn at the request's temperature / top-k / top-p with the
engine's own ``sampling_probs`` (temperature 0: one-hot at the argmax), over the target vocabulary with zeros
outside a reduced draft vocabulary; d_j uses ``stream_uniforms(seed, position + j, STREAM_DRAFT)`` like
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
from dataclasses import dataclass

import torch
from torch import nn

from k3post.rollout.engine import _inverse_cdf
from k3post.rollout.speculative import STREAM_DRAFT, DraftRow, row_sampling_probs, stream_uniforms
from k3post.spec.eagle3 import Eagle3Draft, target_features

log = logging.getLogger("k3post.spec")

__all__ = ["Eagle3Drafter"]


@dataclass
class _RowKV:
    """One request's step-0 entries of positions 0 … P-1: entry t read features_t and ids[t+1]."""

    ids: list[int]
    k_KPd: torch.Tensor
    v_KPd: torch.Tensor
    out_PD: torch.Tensor

    @property
    def held(self) -> int:
        return self.k_KPd.shape[1]

    def truncate(self, num_positions: int) -> None:
        self.k_KPd, self.v_KPd = self.k_KPd[:, :num_positions], self.v_KPd[:, :num_positions]
        self.out_PD = self.out_PD[:num_positions]


def _pad_held(states: Sequence[_RowKV]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Held keys / values right-padded to the longest row: (k_BKPd, v_BKPd, held_B)."""
    P = max(s.held for s in states)
    k = torch.stack([nn.functional.pad(s.k_KPd, (0, 0, 0, P - s.held)) for s in states])
    v = torch.stack([nn.functional.pad(s.v_KPd, (0, 0, 0, P - s.held)) for s in states])
    return k, v, torch.tensor([s.held for s in states], device=k.device)


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
        self._rows: dict[str, _RowKV] = {}
        self.forwards = 0  # draft forwards (the context chunk and each drafted step count one)
        self.rebuilds = 0  # rows whose features were recomputed with the target
        self.zero_filled = 0  # context positions drafted from zero features (a gap and no target to fill it)

    def bind(self, max_sequences: int, max_len: int, vocab_size: int) -> None:
        if int(self.draft.target_ids.max()) >= vocab_size:
            raise ValueError(f"Eagle3Drafter: the draft vocabulary maps to target ids up to "
                             f"{int(self.draft.target_ids.max())}, beyond the target's {vocab_size}")
        self._vocab = vocab_size
        self._rows.clear()

    def rollback(self, key: str, num_tokens: int) -> None:
        st = self._rows.get(key)
        if st is not None:
            del st.ids[num_tokens:]
            st.truncate(min(st.held, max(0, num_tokens - 1)))

    def release(self, key: str) -> None:
        self._rows.pop(key, None)

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
        if not self._vocab:
            raise ValueError("Eagle3Drafter.propose before bind (pass it to EmbeddedEngine through SpeculativeConfig)")
        with torch.inference_mode():
            return self._propose(rows, k)

    def _propose(self, rows: Sequence[DraftRow], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        draft, block = self.draft, self.draft.midlayer
        dev = draft.fc.weight.device
        B, V = len(rows), self._vocab
        states, new = [], []  # new: (tokens, positions, features) of each row's positions held … n-2
        for r in rows:
            n = len(r.context)
            if n < 2:
                raise ValueError(f"Eagle3Drafter: request {r.key!r} has a context of {n} token; EAGLE-3 drafts from "
                                 "the target's features of the position before the pending token (>= 2 tokens)")
            st = self._rows.get(r.key)
            if st is None:
                st = self._rows[r.key] = _RowKV([], draft.fc.weight.new_zeros(block.n_kv, 0, block.head_dim),
                                                draft.fc.weight.new_zeros(block.n_kv, 0, block.head_dim),
                                                draft.fc.weight.new_zeros(0, draft.fc.weight.shape[0]))
            same = 0  # entry t stays valid while ids[0 .. t+1] are still the context
            while same < min(len(st.ids), n) and st.ids[same] == r.context[same]:
                same += 1
            st.truncate(min(st.held, max(0, same - 1), n - 1))
            P = st.held
            st.ids = list(r.context)
            states.append(st)
            new.append((list(r.context[P + 1: n]), list(range(P, n - 1)), self._features(r, P, n - 1)))
        T = max(len(t) for t, _, _ in new)
        last_BD = torch.stack([st.out_PD[-1] if st.held else st.out_PD.new_zeros(st.out_PD.shape[1])
                               for st in states])
        if T:  # step-0 entries of the new positions: one causal chunk over the held keys
            n_T = [len(t) for t, _, _ in new]
            tok_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
            pos_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
            fused_BT3D = draft.fc.weight.new_zeros(B, T, draft.fc.weight.shape[1])
            for b, (tok, pos, fused) in enumerate(new):
                tok_BT[b, : n_T[b]] = torch.tensor(tok, dtype=torch.long)
                pos_BT[b, : n_T[b]] = torch.tensor(pos, dtype=torch.long)
                fused_BT3D[b, : n_T[b]] = fused
            hidden_BTD = draft.fc(fused_BT3D)
            q, kk, vv = block.qkv(draft.embed_tokens(tok_BT), hidden_BTD, pos_BT)
            k_held, v_held, held_B = _pad_held(states)
            Ph = k_held.shape[2]
            s_S = torch.arange(Ph + T, device=dev)
            t_T = torch.arange(T, device=dev)
            allowed_B1TS = ((s_S[None, None, :] < held_B[:, None, None])
                            | ((s_S[None, None, :] >= Ph) & (s_S[None, None, :] - Ph <= t_T[None, :, None])))[:, None]
            out_BTD = block.finish(hidden_BTD, block.attend(q, torch.cat([k_held, kk], 2), torch.cat([v_held, vv], 2),
                                                            allowed_B1TS))
            self.forwards += 1
            for b, st in enumerate(states):
                m = n_T[b]
                if m:
                    st.k_KPd = torch.cat([st.k_KPd, kk[b, :, :m]], 1)
                    st.v_KPd = torch.cat([st.v_KPd, vv[b, :, :m]], 1)
                    st.out_PD = torch.cat([st.out_PD, out_BTD[b, :m]], 0)
                    last_BD[b] = out_BTD[b, m - 1]
        # drafting: step 0 from out_{n-2}, then steps 1 … k-1 over the held entries and the drafted keys
        k_held, v_held, held_B = _pad_held(states)
        Ph = k_held.shape[2]
        pos_B = held_B.clone()  # RoPE position of drafted step j+1 (j = 0 …): n-2+j+1 = held + j
        target_ids = draft.target_ids.to(dev)
        sampling = [r.sampling for r in rows]
        seeds = [r.seed for r in rows]
        draft_BK = torch.zeros(B, k, dtype=torch.long)
        q_BKV = torch.zeros(B, k, V, dtype=torch.float64)
        keys, values = [k_held], [v_held]
        h_BD = last_BD
        for j in range(k):
            logits_BV = h_BD.new_full((B, V), float("-inf"))
            logits_BV[:, target_ids] = draft.logits(h_BD).to(logits_BV.dtype)
            q_BV = row_sampling_probs(logits_BV[:, None], sampling)[:, 0].cpu()
            d_B = _inverse_cdf(torch.cumsum(q_BV, dim=-1), stream_uniforms(seeds, [r.position + j for r in rows],
                                                                           STREAM_DRAFT))
            q_BKV[:, j] = q_BV
            draft_BK[:, j] = d_B
            if j == k - 1:
                break
            q, kk, vv = block.qkv(draft.embed_tokens(d_B.to(dev)[:, None]), h_BD[:, None], (pos_B + j)[:, None])
            keys.append(kk)
            values.append(vv)
            s_S = torch.arange(Ph + j + 1, device=dev)
            allowed_B11S = ((s_S[None, :] < held_B[:, None]) | (s_S[None, :] >= Ph))[:, None, None]
            h_BD = block.finish(h_BD[:, None], block.attend(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                            allowed_B11S))[:, 0]
            self.forwards += 1
        return draft_BK, q_BKV
