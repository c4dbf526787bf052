"""The EAGLE-3 draft (SPEC §6.2): fused target features, one ``MidLayer``, a norm and a (reduced) head.

    hidden_0 = fc([h_low ; h_mid ; h_high])            fc: Linear(3D → D, no bias), initialised [0 0 I]
    step i at position t (i = 0 … steps-1), reading token x_{t+1+i} at RoPE position t+i:
        out_i = midlayer(embed(x_{t+1+i}), hidden_i)   hidden_{i+1} = out_i (pre-norm: its own output)
        logits_i[t] = lm_head(norm(out_i))             predicts x_{t+2+i}, i.e. the target's p at t+1+i

Training-time test (``unrolled_logits``): step i's query at t attends to the causal step-0 keys (s ≤ t, same
sample) and to the one key at t of each step 1 … i: the keys inference holds when it drafts i tokens after
position t (one softmax over T + i scores per query, `MidLayer.attend_unrolled`). Started from an MTP head
(``MTPHead``) whose input is h_high, step 0 is that head exactly; with the stock layout h_high enters the last layer
instead, and `k3post draft` starts fc at the least-squares map onto the final hidden state
(``k3post.spec.train.fit_fc``).

Layer ids (``Eagle3Config.aux_layer_ids``, k3post's convention): id i ∈ [0, L] names the hidden state
*entering* decoder layer i (transformers' ``output_hidden_states[i]`` for i < L); id L names the last layer's
output before the final norm, the state the MTP head reads. vLLM's ``eagle_aux_hidden_state_layer_ids`` count
the same way (it records ``hidden + residual`` before layer i); SGLang's count the state *leaving* a layer
(it records before layer j+1), so SGLang id = k3post id − 1. Neither engine records anything after the last
layer, each layer once and in layer order, and their Llama loops add a residual that does not exist yet
before layer 0, so stock engines serve strictly ascending ids in 1 … L−1 only (``engine_capturable``). The
default, ``stock_aux_layers``, is (1, L//2, L−1): low, middle and the state entering the last layer
(docs/decisions.md, issue 30 §3).

Reduced vocabulary: draft id j ↔ target id ``target_ids[j]`` (ascending); vLLM/SGLang store d2t[j] =
target_ids[j] − j (int64) and t2d (bool over the target vocabulary, True at the draft's ids).

Legend: B batch, T positions, D hidden, V target vocabulary, W draft vocabulary, N steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from k3post.spec.block import MidLayer, decoder_layers
from k3post.spec.mtp import MTPHead, capture_final_hidden

__all__ = [
    "DraftVocab", "Eagle3Config", "Eagle3Draft", "engine_capturable", "from_sglang_ids", "from_vllm_ids",
    "sglang_ids", "step_weights", "stock_aux_layers", "target_features", "unrolled_logits", "unrolled_step_logits",
    "vllm_ids",
]


@dataclass
class DraftVocab:
    """The draft's vocabulary: ``target_ids`` (int64, ascending, unique) of a target vocabulary of ``vocab_size``."""

    target_ids: torch.Tensor
    vocab_size: int

    @property
    def d2t(self) -> torch.Tensor:
        """Offsets as vLLM and SGLang store them: d2t[j] = target_ids[j] − j (int64)."""
        return self.target_ids - torch.arange(len(self.target_ids))

    @property
    def t2d(self) -> torch.Tensor:
        """bool[vocab_size], True exactly at the draft's target ids."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @classmethod
    def from_counts(cls, counts_V: torch.Tensor, size: int) -> "DraftVocab":
        """The ``size`` most frequent target ids (ties: the smaller id first), ascending."""
        if not 0 < size <= len(counts_V):
            raise ValueError(f"draft vocabulary size {size} must be in 1..{len(counts_V)}")
        order = torch.argsort(-counts_V.to(torch.float64), stable=True)
        return cls(order[:size].sort().values.to(torch.int64), len(counts_V))

    @classmethod
    def from_token_ids(cls, token_ids: Iterable[Sequence[int]], vocab_size: int, size: int) -> "DraftVocab":
        """From the token frequencies of the draft's training data (sequences of target ids)."""
        counts_V = torch.zeros(vocab_size, dtype=torch.int64)
        for seq in token_ids:
            counts_V += torch.bincount(torch.as_tensor(seq, dtype=torch.int64), minlength=vocab_size)
        return cls.from_counts(counts_V, size)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        return cls((d2t.to(torch.int64) + torch.arange(len(d2t))), vocab_size)


def vllm_ids(ids: Sequence[int]) -> list[int]:
    """k3post ids → vLLM's ``eagle_aux_hidden_state_layer_ids`` (both name the state entering a layer)."""
    return list(ids)


def from_vllm_ids(ids: Sequence[int]) -> list[int]:
    return list(ids)


def sglang_ids(ids: Sequence[int]) -> list[int]:
    """k3post ids → SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the state leaving layer j)."""
    return [i - 1 for i in ids]


def from_sglang_ids(ids: Sequence[int]) -> list[int]:
    return [j + 1 for j in ids]


def engine_capturable(ids: Sequence[int], num_layers: int) -> bool:
    """True when stock vLLM and SGLang hand the draft exactly these states, in this order: ids strictly
    ascending in 1 … L−1. Both record inside their layer loop, once per layer and in layer order (``if idx in
    layers``), so nothing after the last layer (id L), a repeated id is recorded once (too few features for
    fc) and unsorted ids arrive sorted; before layer 0 their Llama models compute ``hidden_states + residual``
    with no residual yet (id 0 fails there). tests/test_spec_export.py checks this against their source."""
    ids = list(ids)
    return all(1 <= i <= num_layers - 1 for i in ids) and all(a < b for a, b in zip(ids, ids[1:]))


def stock_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The default aux ids of a ``num_layers``-layer target, k3post's count (states entering layers):
    (1, L//2, L−1), the lowest, middle and highest states stock vLLM / SGLang record (``engine_capturable``).
    The high one enters the last layer: the nearest recordable state to the MTP head's input (id L). A target
    of fewer than 4 layers has no three distinct recordable states (a ValueError)."""
    if num_layers < 4:
        raise ValueError(f"a {num_layers}-layer target has fewer than 3 states stock vLLM / SGLang record for "
                         "EAGLE-3 (the states entering layers 1 .. L-1, each once)")
    return 1, num_layers // 2, num_layers - 1


@dataclass
class Eagle3Config:
    """The draft's shape and its target coupling.

    aux_layer_ids: (low, mid, high) in k3post's convention (module docstring); high = L reads what the
        MTP head reads. num_target_layers: L. block: the Llama config of the midlayer (``block_config``).
    draft_vocab: the reduced vocabulary (d2t / t2d maps), None for the full target vocabulary."""

    aux_layer_ids: tuple[int, int, int]
    num_target_layers: int
    block: LlamaConfig
    draft_vocab: DraftVocab | None = None

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.aux_layer_ids)
        if len(ids) != 3 or not all(0 <= i <= self.num_target_layers for i in ids):
            raise ValueError(f"aux_layer_ids must be 3 ids in 0..{self.num_target_layers}, got {self.aux_layer_ids}")
        self.aux_layer_ids = ids  # type: ignore[assignment]

    @property
    def vocab_size(self) -> int:
        return self.block.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab.target_ids)


class Eagle3Draft(nn.Module):
    """fc, midlayer, norm, lm_head (the names vLLM and SGLang load); ``embed_tokens`` is the target's."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        D = config.block.hidden_size
        self.config = config
        self.fc = nn.Linear(3 * D, D, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * D:].copy_(torch.eye(D))
        self.midlayer = MidLayer(config.block)
        self.norm = LlamaRMSNorm(D, eps=config.block.rms_norm_eps)
        self.lm_head = nn.Linear(D, config.draft_vocab_size, bias=False)
        vocab = config.draft_vocab or DraftVocab(torch.arange(config.vocab_size), config.vocab_size)
        self.register_buffer("d2t", vocab.d2t)
        self.register_buffer("t2d", vocab.t2d)
        self.embed_tokens = embed_tokens

    @classmethod
    def from_target(cls, target: nn.Module, aux_layer_ids: Sequence[int], mtp: MTPHead | None = None,
                    draft_vocab: DraftVocab | None = None) -> "Eagle3Draft":
        """A draft for ``target``: midlayer and norm copied from ``mtp`` (else from ``MTPHead.from_target``,
        the target's last layer adapted), lm_head = the target head's rows of the draft vocabulary, the
        target's embedding shared and frozen."""
        head = mtp if mtp is not None else MTPHead.from_target(target)
        embed = target.get_input_embeddings()
        embed.weight.requires_grad_(False)
        cfg = Eagle3Config(tuple(aux_layer_ids), len(decoder_layers(target)), copy.deepcopy(head.config), draft_vocab)
        draft = cls(cfg, embed).to(next(target.parameters()).dtype)
        draft.midlayer.load_state_dict(head.midlayer.state_dict())
        draft.norm.load_state_dict(head.norm.state_dict())
        rows = target.get_output_embeddings().weight
        with torch.no_grad():
            draft.lm_head.weight.copy_(rows if draft_vocab is None else rows[draft_vocab.target_ids])
        return draft

    @property
    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def logits(self, out_BTD: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits_BTW of pre-norm block outputs."""
        return self.lm_head(self.norm(out_BTD))

    def forward(self, fused_BT3D: torch.Tensor, next_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor,
                allowed_B1TT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 (a causal prefill): (logits_BTW, pre-norm out_BTD) from features at t and token x_{t+1}."""
        out_BTD = self.midlayer(self.embed_tokens(next_ids_BT), self.fc(fused_BT3D), position_ids_BT, allowed_B1TT)
        return self.logits(out_BTD), out_BTD


def step_weights(steps: int, decay: float = 0.8) -> torch.Tensor:
    """Per-step loss weights decay**i, i = 0 … steps−1 (EAGLE-3's 0.8^i): [1, 0.8, 0.64, …]."""
    return decay ** torch.arange(steps, dtype=torch.float64)


@torch.no_grad()
def target_features(target: nn.Module, input_ids_BT: torch.Tensor, aux_layer_ids: Sequence[int],
                    position_ids_BT: torch.Tensor | None = None, attention_mask: object = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward: the fused input [h_low ; h_mid ; h_high]_BT3D (k3post ids, module
    docstring) and the final hidden state final_BTD (the last layer's pre-norm output). The target's
    logits are ``target.lm_head(target.model.norm(final_BTD))``."""
    layers = decoder_layers(target)
    L, states = len(layers), {}
    hooks = []
    for i in sorted(set(aux_layer_ids)):
        if not 0 <= i <= L:
            raise ValueError(f"aux layer id {i} is outside 0..{L}")
        if i < L:
            hooks.append(layers[i].register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: states.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True))
    try:
        with capture_final_hidden(target) as final:
            target(input_ids=input_ids_BT, position_ids=position_ids_BT, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    states[L] = final.hidden_BTD
    return torch.cat([states[i] for i in aux_layer_ids], dim=-1), final.hidden_BTD


def _segments(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Sample index of every position (a sample starts where positions restart at 0)."""
    return torch.cumsum((position_ids_BT == 0).long(), dim=1)


def unrolled_logits(draft: Eagle3Draft, fused_BT3D: torch.Tensor, input_ids_BT: torch.Tensor, steps: int = 7,
                    position_ids_BT: torch.Tensor | None = None, pad_id: int = 0) -> torch.Tensor:
    """The training-time-test unroll (module docstring): logits_NBTW, step i at t predicting x_{t+2+i}.

    Teacher forcing: step i reads the true token x_{t+1+i} (``pad_id`` past the row's end; such positions,
    and those whose token lies in another packed sample, must be masked by the loss). The attention is one
    masked softmax over the keys of steps 0 … i."""
    return torch.stack(unrolled_step_logits(draft, fused_BT3D, input_ids_BT, steps, position_ids_BT, pad_id))


def unrolled_step_logits(draft: Eagle3Draft, fused_BT3D: torch.Tensor, input_ids_BT: torch.Tensor, steps: int = 7,
                         position_ids_BT: torch.Tensor | None = None, pad_id: int = 0) -> list[torch.Tensor]:
    """`unrolled_logits` as one logits_BTW per step, for the loss: a step read from the stacked tensor would
    give each step's backward a zero gradient of all N steps' size."""
    B, T = input_ids_BT.shape
    dev = input_ids_BT.device
    pos_BT = torch.arange(T, device=dev).expand(B, T) if position_ids_BT is None else position_ids_BT
    seg_BT = _segments(pos_BT)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    step0_B1TT = (causal_TT & (seg_BT[:, :, None] == seg_BT[:, None, :]))[:, None]
    padded_BT = torch.cat([input_ids_BT, torch.full((B, steps), pad_id, dtype=input_ids_BT.dtype, device=dev)], 1)
    block = draft.midlayer
    hidden_BTD = draft.fc(fused_BT3D)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    out = []
    for i in range(steps):
        tok_BT = padded_BT[:, 1 + i: 1 + i + T]
        q, k, v = block.qkv(draft.embed_tokens(tok_BT), hidden_BTD, pos_BT + i)
        if i == 0:  # the causal step-0 keys
            k0, v0 = k, v
            o = block.attend(q, k, v, step0_B1TT)
        else:  # step 0's keys and, at each t, the key at t of every later step so far
            diag_k.append(k)
            diag_v.append(v)
            o = block.attend_unrolled(q, k0, v0, step0_B1TT, torch.stack(diag_k, 3), torch.stack(diag_v, 3))
        hidden_BTD = block.finish(hidden_BTD, o)
        out.append(draft.logits(hidden_BTD))
    return out
