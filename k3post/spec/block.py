"""The one decoder block shared by the MTP head and the EAGLE-3 draft, in EAGLE-3's ``midlayer`` form.

    x_BT2D = [input_layernorm(embeds_BTD) ; hidden_norm(hidden_BTD)]
    h_BTD  = hidden_BTD + o_proj(attention(q_proj x, k_proj x, v_proj x))      (residual = the hidden input)
    out_BTD = h_BTD + mlp(post_attention_layernorm(h_BTD))                       (dense SwiGLU, Llama's MLP)

This is the layer vLLM's ``Eagle3LlamaForCausalLM`` and SGLang's ``LlamaForCausalLMEagle3`` run (their
``midlayer`` with ``norm_before_residual`` false). DeepSeek-V3's MTP projection M·[norm(h); norm(e)] is
folded into the 2d-input q/k/v projections (docs/decisions.md). Rotary positions follow the target's
``rope_parameters``; there is no q/k norm and no bias, as in those loaders.

Legend: B batch, T query positions, S key positions, D hidden, H query heads, K key/value heads, d head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

__all__ = ["MidLayer", "block_config", "decoder_layers", "init_from_target_layer"]


def block_config(target_config: Any) -> LlamaConfig:
    """The Llama config of a one-layer draft block shaped like the target (hidden size, heads, head dim,
    dense ``intermediate_size``, norm eps, rotary parameters, vocabulary)."""
    cfg = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
    heads = cfg.num_attention_heads
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


class MidLayer(nn.Module):
    """EAGLE-3's first draft layer (module docstring). ``forward`` runs it causally; ``qkv``, ``attend`` and
    ``finish`` are its three parts, for callers that build their own key list (the training-time unroll)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.input_layernorm = LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * D, self.n_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * D, self.n_kv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * D, self.n_kv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)
        self.mlp = LlamaMLP(config)
        self.rotary_emb = LlamaRotaryEmbedding(config)  # inv_freq is a non-persistent buffer: no weights
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def qkv(self, embeds_BTD: torch.Tensor, hidden_BTD: torch.Tensor, position_ids_BT: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries q_BHTd and keys k_BKTd, values v_BKTd of the concatenated normalised inputs."""
        x_BT2D = torch.cat([self.input_layernorm(embeds_BTD), self.hidden_norm(hidden_BTD)], dim=-1)
        B, T, _ = x_BT2D.shape
        attn = self.self_attn
        q = attn.q_proj(x_BT2D).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x_BT2D).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x_BT2D).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(x_BT2D, position_ids_BT)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q_BHTd: torch.Tensor, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor,
               allowed_B1TS: torch.Tensor) -> torch.Tensor:
        """Softmax attention of each query over the keys it is allowed (bool mask, True = attend): o_BHTd."""
        groups = self.n_heads // self.n_kv
        return F.scaled_dot_product_attention(
            q_BHTd, repeat_kv(k_BKSd, groups), repeat_kv(v_BKSd, groups), attn_mask=allowed_B1TS,
            scale=self.head_dim ** -0.5,
        )

    def attend_unrolled(self, q_BHTd: torch.Tensor, k0_BKTd: torch.Tensor, v0_BKTd: torch.Tensor,
                        allowed0_B1TT: torch.Tensor, kd_BKTNd: torch.Tensor, vd_BKTNd: torch.Tensor) -> torch.Tensor:
        """The training-time test's attention at unrolled step N ≥ 1 (`k3post.spec.eagle3.unrolled_logits`): the
        query at t over the step-0 keys it is allowed (``allowed0``) and over the N keys at t of steps 1 … N
        (``kd``/``vd`` stack them on their fourth axis), in one softmax. The same softmax as `attend` over the
        concatenated keys [k0, k1, …, kN] with the diagonal masks, without computing the N · T · T masked-out
        scores of the later steps: T · (T + N) scores a head instead of T · (N + 1) · T."""
        groups = self.n_heads // self.n_kv
        scale = self.head_dim ** -0.5
        k0, v0 = repeat_kv(k0_BKTd, groups), repeat_kv(v0_BKTd, groups)
        B, K, T, N, d = kd_BKTNd.shape
        kd = kd_BKTNd[:, :, None].expand(B, K, groups, T, N, d).reshape(B, K * groups, T, N, d)
        vd = vd_BKTNd[:, :, None].expand(B, K, groups, T, N, d).reshape(B, K * groups, T, N, d)
        q_BHTd = q_BHTd * scale
        s0_BHTT = (q_BHTd @ k0.transpose(-1, -2)).masked_fill(~allowed0_B1TT, float("-inf"))
        sd_BHTN = torch.einsum("bhtd,bhtnd->bhtn", q_BHTd, kd)
        # the softmax over [s0, sd] in two parts (no concatenated copy, no sliced gradients): every query may
        # attend to its own step-0 key, so each row holds a finite score
        m_BHT1 = torch.maximum(s0_BHTT.amax(-1, keepdim=True), sd_BHTN.amax(-1, keepdim=True)).detach()
        e0, ed = torch.exp(s0_BHTT - m_BHT1), torch.exp(sd_BHTN - m_BHT1)
        z_BHT1 = e0.sum(-1, keepdim=True) + ed.sum(-1, keepdim=True)
        return (e0 @ v0 + torch.einsum("bhtn,bhtnd->bhtd", ed, vd)) / z_BHT1

    def finish(self, hidden_BTD: torch.Tensor, o_BHTd: torch.Tensor) -> torch.Tensor:
        """Output projection, the residual (the hidden input), then the MLP block: the pre-norm out_BTD."""
        B, _, T, _ = o_BHTd.shape
        h_BTD = hidden_BTD + self.self_attn.o_proj(o_BHTd.transpose(1, 2).reshape(B, T, -1))
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))

    def forward(self, embeds_BTD: torch.Tensor, hidden_BTD: torch.Tensor, position_ids_BT: torch.Tensor,
                allowed_B1TT: torch.Tensor | None = None) -> torch.Tensor:
        """Causal run (or under ``allowed_B1TT``, e.g. packed rows' block-diagonal mask): the pre-norm out_BTD."""
        q, k, v = self.qkv(embeds_BTD, hidden_BTD, position_ids_BT)
        if allowed_B1TT is None:
            T = q.shape[2]
            allowed_B1TT = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
        return self.finish(hidden_BTD, self.attend(q, k, v, allowed_B1TT))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers (HF causal LMs: ``model.get_decoder().layers``)."""
    return model.get_decoder().layers


@torch.no_grad()
def init_from_target_layer(block: MidLayer, layer: nn.Module) -> None:
    """Start ``block`` from a target decoder layer, adapted to the 2d input: q/k/v read the hidden half
    with the target's weights and the embedding half with zeros (so the block first computes the target's
    attention over ``hidden_norm(hidden)``); both input norms take the target's ``input_layernorm``; o_proj
    and ``post_attention_layernorm`` are copied. The MLP is copied when the target's is dense with the same
    shape (Llama-style ``gate_proj``/``up_proj``/``down_proj``); a MoE layer's MLP keeps its random init.
    A Qwen3-style q/k norm has no place in the EAGLE-3 layer and is dropped."""
    D = block.hidden_norm.weight.shape[0]
    src = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(block.self_attn, name).weight
        w.zero_()
        w[:, D:].copy_(getattr(src, name).weight)
    block.self_attn.o_proj.weight.copy_(src.o_proj.weight)
    block.input_layernorm.weight.copy_(layer.input_layernorm.weight)
    block.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    block.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    dense = all(getattr(getattr(layer.mlp, n, None), "weight", None) is not None
                and getattr(layer.mlp, n).weight.shape == getattr(block.mlp, n).weight.shape
                for n in ("gate_proj", "up_proj", "down_proj"))
    if dense:
        block.mlp.load_state_dict(layer.mlp.state_dict())
