"""Speculative decoding in the embedded engine (SPEC §6.2): chain drafting and rejection sampling.

A ``Drafter`` (`k3post.rollout.model_drafter.ModelDrafter`, `k3post.spec.drafter.Eagle3Drafter`) proposes k tokens per running sequence with the distributions q it drew them from; one
target forward over the chunk [pending token, d_1 .. d_k] of every row (k+1 positions on the slot KV
cache) gives p at each position, and ``verify_drafts`` keeps the target's law (Leviathan et al. 2023;
Chen et al. 2023):

    accept d_j  with probability  min(1, p_j(d_j) / q_j(d_j))        (j = 1.., until the first rejection)
    first rejection at j:  emit a token from norm(max(0, p_j - q_j))
    all k accepted:        emit a bonus token from p_{k+1}

so every round emits a + 1 tokens (a accepted drafts) for one target forward. p and q are the
distributions the engine samples from (``k3post.rollout.engine.sampling_probs``: the request's
temperature, top-k and top-p; temperature 0 is one-hot at the argmax, which makes the rule "accept iff
the draft is the target's argmax" and the emitted token the argmax: plain greedy decoding).

Randomness is counter-based per request, like plain sampling: the draw that decides output position i
is ``stream_uniforms(seed, i, stream)`` with one stream for drafting, one for the accept test and one for
the residual / bonus draw. A position's draws are used by the one round that settles it (drafts after a
rejection are discarded unseen), so the law is exact, and the tokens do not depend on batch composition,
slots, or on a pause / resume (rounds start where the last one ended).

The engine hands a drafter per row: the context (prompt + output ids; the last is pending, not yet fed to
the target), the sampling parameters and seed, and, for drafters that read the target's hidden states
(EAGLE-3: ``aux_layers``), the target's hidden states after those layers for the context positions the
target computed since the last proposal. Drafters keep their own per-sequence state keyed by request id
and are told what to keep (``rollback``) and what to forget (``release``: finished, paused, aborted);
a request they hold nothing for (new, resumed, imported) is rebuilt from its context.

Shape legend:
    B   rows (running sequences)
    K   drafted tokens per row (k)
    T   verified positions per row (k + 1)
    V   target vocabulary
    A   aux layers,  D  hidden size,  N  positions with hidden states
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from k3post.rollout.engine import SamplingParams, _inverse_cdf, _splitmix64, sampling_probs, token_uniforms

__all__ = [
    "DraftRow",
    "Drafter",
    "SpeculativeConfig",
    "STREAM_DRAFT",
    "STREAM_ACCEPT",
    "STREAM_RESIDUAL",
    "stream_uniforms",
    "acceptance_probs",
    "residual_probs",
    "verify_drafts",
    "row_sampling_probs",
]

STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2, 3
"""The counter streams of speculative decoding: drafting, the accept test, the residual / bonus draw."""


def stream_uniforms(seeds: Sequence[int], positions: Sequence[int], stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64 [B]: ``token_uniform(splitmix64(seed + stream * 2^32), position)``,
    independent of plain sampling's stream (``token_uniform(seed, position)``) and of each other."""
    return token_uniforms([_splitmix64((s + (stream << 32)) & ((1 << 64) - 1)) for s in seeds], positions)


def acceptance_probs(p_S: torch.Tensor, q_S: torch.Tensor) -> torch.Tensor:
    """min(1, p / q) elementwise (0 where p = 0; 1 where q = 0 < p, a draft q could not have drawn)."""
    return torch.where(q_S > 0, (p_S / q_S.clamp(min=torch.finfo(q_S.dtype).tiny)).clamp(max=1.0), (p_S > 0).to(p_S.dtype))


def residual_probs(p_SV: torch.Tensor, q_SV: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; rows where it has no mass (p <= q everywhere, i.e. p = q: a
    rejection there has probability 0) fall back to p."""
    r_SV = (p_SV - q_SV).clamp(min=0.0)
    mass_S1 = r_SV.sum(-1, keepdim=True)
    return torch.where(mass_S1 > 0, r_SV / mass_S1.clamp(min=torch.finfo(r_SV.dtype).tiny), p_SV)


def verify_drafts(
    p_BTV: torch.Tensor,
    q_BKV: torch.Tensor,
    draft_BK: torch.Tensor,
    k_B: torch.Tensor,
    u_accept_BK: torch.Tensor,
    u_residual_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one round for B rows (Leviathan et al. 2023, Algorithm 1):

        accept_j = u_accept_j < min(1, p_j(d_j) / q_j(d_j))   for j < k_b
        a        = number of leading accepted drafts
        next     ~ norm(max(0, p_a - q_a))  if a < k_b,  else p_a (bonus)    (inverse CDF with u_residual_a,
                                                                          vocabulary order)

    Args:
        p_BTV: target distributions at the T = K+1 verified positions (float64; rows past k_b ignored).
        q_BKV: draft distributions of the K drafted tokens.
        draft_BK: drafted token ids.
        k_B: drafts verified per row (0..K).
        u_accept_BK, u_residual_BT: float64 uniforms (``stream_uniforms``, STREAM_ACCEPT / STREAM_RESIDUAL).
    Returns:
        (a_B accepted drafts, next_B the token emitted after them), int64.
    """
    B, K = draft_BK.shape
    j_K = torch.arange(K, device=draft_BK.device)
    p_BK = p_BTV[:, :K].gather(2, draft_BK[:, :, None]).squeeze(2)
    q_BK = q_BKV.gather(2, draft_BK[:, :, None]).squeeze(2)
    ok_BK = (u_accept_BK < acceptance_probs(p_BK, q_BK)) & (j_K[None] < k_B[:, None])
    a_B = ok_BK.long().cumprod(1).sum(1)
    rows_B = torch.arange(B, device=draft_BK.device)
    p_a_BV = p_BTV[rows_B, a_B]
    rejected_B = a_B < k_B
    dist_BV = p_a_BV
    if bool(rejected_B.any()):
        q_a_BV = q_BKV[rows_B, a_B.clamp(max=K - 1)] if K else torch.zeros_like(p_a_BV)
        dist_BV = torch.where(rejected_B[:, None], residual_probs(p_a_BV, q_a_BV), p_a_BV)
    next_B = _inverse_cdf(torch.cumsum(dist_BV, dim=-1), u_residual_BT[rows_B, a_B])
    return a_B, next_B


def row_sampling_probs(logits_BSV: torch.Tensor, sampling: Sequence[SamplingParams]) -> torch.Tensor:
    """``sampling_probs`` of S positions per row, row b at ``sampling[b]``'s temperature / top-k / top-p:
    float64 [B, S, V]."""
    B, S, V = logits_BSV.shape
    dev = logits_BSV.device
    if all(sp.temperature > 0 and (sp.top_k <= 0 or sp.top_k >= V) and sp.top_p >= 1.0 for sp in sampling):
        # every row unfiltered: sampling_probs' ops on those rows (softmax(logits / T) in fp32, then float64)
        temp_B11 = torch.tensor([float(sp.temperature) for sp in sampling], dtype=torch.float32, device=dev)
        return torch.softmax(logits_BSV.float() / temp_B11[:, None, None], dim=-1).double()
    params_3B = torch.tensor([[sp.temperature for sp in sampling], [float(sp.top_k) for sp in sampling],
                              [sp.top_p for sp in sampling]], dtype=torch.float64, device=dev)
    params_3N = params_3B.repeat_interleave(S, dim=1)
    return sampling_probs(logits_BSV.reshape(B * S, V), params_3N[0].float(), params_3N[1].long(),
                          params_3N[2].float()).view(B, S, V)


# --------------------------------------------------------------------------- the drafter protocol


@dataclass
class DraftRow:
    """What a drafter is told about one running sequence.

    Fields:
        key: the request id (a drafter's per-sequence state is keyed by it, never by slot).
        context: prompt + output ids; the last id is pending (the target has not computed it yet).
        sampling: the request's sampling parameters (q is drawn at its temperature / top-k / top-p).
        seed: the request seed; draft j of this round draws ``stream_uniforms(seed, position + j,
            STREAM_DRAFT)``.
        position: output index of the first drafted token (len(output ids)).
        aux_hidden: None unless the drafter has ``aux_layers``; then the target's hidden states after
            those layers, [N, A, D], for context positions aux_start .. aux_start + N - 1 (those the target
            computed since the last proposal; a gap after a resume or a KV import shows as aux_start
            beyond what the drafter holds).
        aux_start: the context position of aux_hidden's first row.
    """

    key: str
    context: Sequence[int]
    sampling: SamplingParams
    seed: int
    position: int
    aux_hidden: torch.Tensor | None = None
    aux_start: int = 0


@runtime_checkable
class Drafter(Protocol):
    """A draft model the engine drives (classic: `k3post.rollout.model_drafter.ModelDrafter`; EAGLE-3 reads
    ``aux_layers``)."""

    aux_layers: tuple[int, ...]
    """Target decoder layers whose output hidden states the drafter reads (empty: none)."""

    def bind(self, max_sequences: int, max_len: int, vocab_size: int) -> None:
        """Called once by the engine: at most ``max_sequences`` live sequences of ``max_len`` positions;
        q must span ``vocab_size`` target ids."""
        ...

    def propose(self, rows: Sequence[DraftRow], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft_BK token ids int64, q_BKV their draft distributions over the target vocabulary; zeros
        outside a reduced draft vocabulary). Row b's state afterwards covers at least its context."""
        ...

    def rollback(self, key: str, num_tokens: int) -> None:
        """Only the first ``num_tokens`` tokens of what ``key``'s state has seen are still its context."""
        ...

    def release(self, key: str) -> None:
        """Forget ``key`` (finished, paused, aborted); unknown keys are ignored."""
        ...


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in ``EmbeddedEngine``.

    Fields:
        drafter: the draft model (a ``Drafter``).
        num_draft_tokens: k, tokens drafted and verified per row and round (>= 1).
    """

    drafter: Any
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"SpeculativeConfig.drafter must implement Drafter, got {type(self.drafter).__name__}")
        if not isinstance(self.num_draft_tokens, int) or isinstance(self.num_draft_tokens, bool) \
                or self.num_draft_tokens < 1:
            raise ValueError(f"SpeculativeConfig.num_draft_tokens must be an int >= 1, got {self.num_draft_tokens!r}")
