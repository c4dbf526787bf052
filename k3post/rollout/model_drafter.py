"""Classic speculative decoding's drafter: a small causal LM over the target's token ids (`ModelDrafter`).

The draft model runs as an embedded engine of its own, used as a forward over slot KV caches (its lean or
general path). Engines are built by the factory only: `k3post.rollout.factory.model_drafter` makes a drafter whose
``build_forward`` is the factory's (`k3post.rollout.factory.draft_forward`), called in ``bind`` once the driving
engine says how many sequences and positions it needs. The speculative machinery (`k3post.rollout.speculative`) sits
below this module and the factory above it: neither circle closes.

Shape legend: B rows, K drafted tokens per row, V target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from k3post.rollout.engine import _inverse_cdf
from k3post.rollout.speculative import STREAM_DRAFT, DraftRow, row_sampling_probs, stream_uniforms

__all__ = ["ModelDrafter"]


class ModelDrafter:
    """Classic speculative decoding: a small causal LM over the target's token ids drafts autoregressively.

    It runs an embedded engine of its own over the draft model (lean or general path, slot KV caches) as
    a forward, with one slot per live request: a proposal feeds each row's context past what its slot
    holds (the whole context for a new or resumed row), then k - 1 single tokens, drawing d_j from q_j
    (the request's temperature / top-k / top-p on the draft logits). ``rollback`` shortens what a slot
    holds (the positions past it are simply overwritten); ``release`` frees the slot.
    """

    aux_layers: tuple[int, ...] = ()

    def __init__(self, model: nn.Module, path: str = "auto",
                 build_forward: Callable[[nn.Module, int, int, str], Any] | None = None) -> None:
        """``build_forward(model, max_sequences, max_len, path)``: the engine that runs the draft model (the
        factory's `k3post.rollout.factory.draft_forward`; `k3post.rollout.factory.model_drafter` wires it)."""
        self.model = model
        self.path = path
        self._build_forward = build_forward
        self._fwd: Any = None
        self._vocab = 0
        self._slot: dict[str, int] = {}
        self._ids: dict[str, list[int]] = {}  # token ids whose K/V the slot holds
        self._free: list[int] = []
        self.forwards = 0  # draft forwards (one per drafted position per round)

    def bind(self, max_sequences: int, max_len: int, vocab_size: int) -> None:
        n_draft = int(self.model.get_input_embeddings().num_embeddings)
        if n_draft > vocab_size:
            raise ValueError(f"ModelDrafter: the draft vocabulary ({n_draft}) is larger than the target's ({vocab_size})")
        if self._build_forward is None:
            raise ValueError("ModelDrafter: no forward builder; make the drafter with "
                             "k3post.rollout.factory.model_drafter(model) (engines are built by the factory only)")
        self._fwd = self._build_forward(self.model, max_sequences, max_len, self.path)
        self._vocab = vocab_size
        self._free = list(range(max_sequences - 1, -1, -1))
        self._slot.clear()
        self._ids.clear()

    def rollback(self, key: str, num_tokens: int) -> None:
        ids = self._ids.get(key)
        if ids is not None:
            del ids[num_tokens:]

    def release(self, key: str) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            del self._ids[key]

    def propose(self, rows: Sequence[DraftRow], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fwd is None:
            raise ValueError("ModelDrafter.propose before bind (pass it to EmbeddedEngine through SpeculativeConfig)")
        B, V = len(rows), self._vocab
        slots, chunks, starts = [], [], []
        for r in rows:
            if r.key not in self._slot:
                self._slot[r.key] = self._free.pop()
                self._ids[r.key] = []
            ids = self._ids[r.key]
            n = 0  # keep the longest prefix of what the slot holds that is still the context
            while n < len(ids) and n < len(r.context) - 1 and ids[n] == r.context[n]:
                n += 1
            del ids[n:]
            slots.append(self._slot[r.key])
            starts.append(n)
            chunks.append(list(r.context[n:]))
        seeds = [r.seed for r in rows]
        draft_BK = torch.zeros(B, k, dtype=torch.long)
        q_BKV = torch.zeros(B, k, V, dtype=torch.float64)
        fwd = self._fwd
        with torch.inference_mode():
            for j in range(k):
                logits_BV = fwd._forward_chunks(chunks, starts, slots)
                self.forwards += 1
                q_BV = row_sampling_probs(logits_BV[:, None], [r.sampling for r in rows])[:, 0].cpu()
                u_B = stream_uniforms(seeds, [r.position + j for r in rows], STREAM_DRAFT)
                d_B = _inverse_cdf(torch.cumsum(q_BV, dim=-1), u_B)
                q_BKV[:, j, : q_BV.shape[1]] = q_BV
                draft_BK[:, j] = d_B
                for b, r in enumerate(rows):
                    self._ids[r.key].extend(chunks[b])
                starts = [st + len(c) for st, c in zip(starts, chunks)]
                chunks = [[t] for t in d_B.tolist()]
        return draft_BK, q_BKV
