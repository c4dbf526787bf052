"""The embedded engine's speculative rounds (`k3post.rollout.embedded.engine.EmbeddedEngine` with a
``SpeculativeConfig``): admission that leaves each context's last token pending, and one draft-then-verify round
per decode step (`k3post.rollout.speculative` holds the drafters and the acceptance rule).

Shape legend: B sequences, T = K + 1 positions a row verifies, K drafted tokens, V vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from k3post.rollout.speculative import (STREAM_ACCEPT, STREAM_RESIDUAL, DraftRow, row_sampling_probs, stream_uniforms,
                                        verify_drafts)

if TYPE_CHECKING:
    from k3post.rollout.embedded.engine import _Seq

__all__ = ["SpeculativeRounds"]


class SpeculativeRounds:
    """Mixin: the speculative admission and round of `EmbeddedEngine`, which provides the state they read
    (``_spec``, ``_forward``, ``_lean``, ``stats``, ``device``, ``max_model_len``, ``prefix_sharing``) and the
    helpers they call (``_share_common_prefix``, ``_forward_chunks``, ``_append``)."""

    _spec: Any
    _forward: Any
    _lean: Any
    stats: dict[str, Any]

    def _prefill_spec(self, seqs: list["_Seq"]) -> None:
        """Admission under speculative decoding: prefill each context but its last token, which stays
        pending for the next step's round (so a fresh, resumed or re-submitted request enters the same
        state, and its tokens are the ones an uninterrupted run draws)."""
        if self.prefix_sharing and not self._forward.capture_layers:  # a drafter reading hidden states needs every row's
            self._share_common_prefix(seqs)
        for s in seqs:
            s.aux, s.aux_start = [], s.n_cached
        rows = [s for s in seqs if s.n_cached < len(s.context) - 1]
        if rows:
            self._forward_chunks([s.context[s.n_cached : -1] for s in rows], [s.n_cached for s in rows],
                                 [s.slot for s in rows], logits=False)
        for b, s in enumerate(rows):
            if self._forward.captured is not None:
                s.aux.append(self._forward.captured[b, : len(s.context) - 1 - s.n_cached])
            s.n_cached = len(s.context) - 1

    def _decode_spec(self, seqs: list["_Seq"], finished: list["_Seq"], reasons: dict[str, str]) -> None:
        """One speculative round for the sequences in slots 0..B-1: the drafter proposes k tokens per row,
        one target forward over [pending, d_1 .. d_kb] per row (kb = k, fewer near max_model_len) gives p
        at every position, ``verify_drafts`` accepts a prefix and draws the next token; the accepted
        tokens and that one are appended (cut at a stop id / max_tokens), with the target's raw
        log-probs; the KV of rejected positions is left behind n_cached (overwritten later)."""
        assert self._spec is not None
        k, drafter, dev = self._spec.num_draft_tokens, self._spec.drafter, self.device
        sps = [s.request.sampling for s in seqs]
        rows = [DraftRow(s.rid, s.context, sp, s.seed, len(s.output_ids)) for s, sp in zip(seqs, sps)]
        if self._forward.capture_layers:  # the target's hidden states of the positions computed since the last proposal
            for s, r in zip(seqs, rows):
                r.aux_hidden, r.aux_start = (torch.cat(s.aux) if s.aux else None), s.aux_start
                s.aux_start += sum(len(h) for h in s.aux)
                s.aux = []
        draft_BK, q_BKV = drafter.propose(rows, k)
        draft_BK, q_BKV = draft_BK.to(dev), q_BKV.to(dev, torch.float64)
        k_list = [min(k, self.max_model_len - len(s.context) - 1) for s in seqs]
        drafts = draft_BK.tolist()
        chunks = [[s.context[-1]] + d[:kb] for s, d, kb in zip(seqs, drafts, k_list)]
        if self._lean is None:
            logits_BTV = self._forward_chunks(chunks, [s.n_cached for s in seqs], [s.slot for s in seqs],
                                              all_positions=True)
        else:
            assert all(s.slot == b for b, s in enumerate(seqs)), "the verify forward reads slots 0..B-1"
            logits_BTV = self._lean.verify(chunks, [s.n_cached for s in seqs])
        assert logits_BTV is not None
        T = k + 1
        if logits_BTV.shape[1] < T:  # every row capped by max_model_len: pad (those positions are unused)
            logits_BTV = F.pad(logits_BTV, (0, 0, 0, T - logits_BTV.shape[1]))
        p_BTV = row_sampling_probs(logits_BTV, sps)
        seeds = [s.seed for s in seqs]
        pos = [len(s.output_ids) + j for s in seqs for j in range(T)]
        u_acc_BT = stream_uniforms([x for x in seeds for _ in range(T)], pos, STREAM_ACCEPT).view(-1, T).to(dev)
        u_res_BT = stream_uniforms([x for x in seeds for _ in range(T)], pos, STREAM_RESIDUAL).view(-1, T).to(dev)
        k_B = torch.tensor(k_list, dtype=torch.long, device=dev)
        a_B, next_B = verify_drafts(p_BTV, q_BKV, draft_BK, k_B, u_acc_BT[:, :k], u_res_BT)
        logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
        st = self.stats
        st["spec_target_forwards"] += 1
        for b, (s, a, nxt) in enumerate(zip(seqs, a_B.tolist(), next_B.tolist())):
            st["spec_drafted"] += k_list[b]
            st["spec_accepted"] += a
            st["spec_emitted"] += a + 1
            n_ctx = len(s.context)
            for j, tok in enumerate(drafts[b][:a] + [nxt]):
                if self._append(s, tok, float(logp_BTV[b, j, tok]), finished, reasons):
                    break
            m = len(s.context) - n_ctx  # emitted (a + 1, fewer when a stop / the length cut the run)
            if self._forward.captured is not None:  # hidden states of the pending token and the accepted drafts
                s.aux.append(self._forward.captured[b, :m])
            s.n_cached += m
            self.stats["decode_tokens"] += m
            drafter.rollback(s.rid, n_ctx + m - 1)
        rows_seen = st["spec_emitted"] - st["spec_accepted"]  # one (row, round) pair per emitted next token
        st["spec_acceptance_rate"] = st["spec_accepted"] / max(1, st["spec_drafted"])
        st["spec_acceptance_length"] = st["spec_emitted"] / max(1, rows_seen)
