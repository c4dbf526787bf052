"""A DeepSeek-V3-style MTP head for a HF decoder, in EAGLE-3's ``midlayer`` form (SPEC §6.2).

At position t the head reads the target's final hidden state h_t and the embedding of token t+1 and
predicts token t+2:

    out_t = midlayer(embed(x_{t+1}), h_t)            (``k3post.spec.block.MidLayer``, RoPE position t)
    logits_t = target_lm_head(norm(out_t))           (embedding and LM head shared with the target)

"Final hidden state" is the last decoder layer's output before the final norm (captured with a forward
hook: transformers 5.24's ``output_hidden_states[-1]`` is the normed output). SFT trains the head as an
auxiliary loss, mtp_weight · CE(logits_t, x_{t+2}) over the positions whose next token is trainable one
step later and in the same sample (``mtp_labels``). Its weights live in ``mtp.safetensors`` (keys
``mtp.*``) beside the model's own files, so ``AutoModelForCausalLM.from_pretrained`` loads the folder
unchanged.

Legend: B batch (packed rows), T positions, D hidden, V vocabulary.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from k3post.spec.block import MidLayer, block_config, decoder_layers, init_from_target_layer

__all__ = ["MTP_FILE", "MTPHead", "capture_final_hidden", "load_mtp", "mtp_ce_sum", "mtp_labels", "save_mtp"]

MTP_FILE = "mtp.safetensors"
_PREFIX = "mtp."


class MTPHead(nn.Module):
    """One ``MidLayer`` and a final norm; the target owns the embedding and the LM head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.midlayer = MidLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @classmethod
    def from_target(cls, target: nn.Module) -> "MTPHead":
        """A head shaped like ``target`` whose block starts from the target's last decoder layer
        (``init_from_target_layer``) and whose norm starts from the target's final norm."""
        head = cls(block_config(target.config)).to(next(target.parameters()).dtype)
        init_from_target_layer(head.midlayer, decoder_layers(target)[-1])
        with torch.no_grad():
            head.norm.weight.copy_(target.get_decoder().norm.weight)
        return head

    def forward(self, embeds_BTD: torch.Tensor, hidden_BTD: torch.Tensor, position_ids_BT: torch.Tensor,
                allowed_B1TT: torch.Tensor | None = None) -> torch.Tensor:
        """The block's pre-norm output out_BTD (causal, or under the given attention mask)."""
        return self.midlayer(embeds_BTD, hidden_BTD, position_ids_BT, allowed_B1TT)

    def logits(self, target: nn.Module, next_ids_BT: torch.Tensor, hidden_BTD: torch.Tensor,
               position_ids_BT: torch.Tensor, allowed_B1TT: torch.Tensor | None = None, *,
               detach_target: bool = False) -> torch.Tensor:
        """logits_BTV for token t+2 from h_t and token ``next_ids_BT[t]`` (= x_{t+1}), through the target's
        embedding and LM head. ``detach_target``: no gradient reaches the target, neither through h_t nor
        through the shared embedding and LM head (their weights are read detached): only the head learns."""
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if not detach_target:
            out_BTD = self(embed(next_ids_BT), hidden_BTD, position_ids_BT, allowed_B1TT)
            return lm_head(self.norm(out_BTD))
        with torch.no_grad():
            embeds_BTD = embed(next_ids_BT)
        out_BTD = self(embeds_BTD, hidden_BTD.detach(), position_ids_BT, allowed_B1TT)
        frozen = {name: p.detach() for name, p in lm_head.named_parameters()}
        return torch.func.functional_call(lm_head, frozen, (self.norm(out_BTD),))


class _Captured:
    hidden_BTD: torch.Tensor | None = None


@contextmanager
def capture_final_hidden(target: nn.Module) -> Iterator[_Captured]:
    """Within the block, every forward of ``target`` stores its last decoder layer's output (pre-norm) in
    the yielded object's ``hidden_BTD``."""
    box = _Captured()

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        box.hidden_BTD = output[0] if isinstance(output, tuple) else output

    handle = decoder_layers(target)[-1].register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def mtp_labels(labels_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """The MTP targets: label_BT[t] = labels[t+1] (token t+2) where t+1 continues t's sample, else -100.

    ``labels_BT`` are next-token labels (-100 = not trained); a sample starts where positions restart.
    Example: labels [5, 6, -100 | 8, 9, -100], positions [0, 1, 2 | 0, 1, 2] → [6, -100, -100 | 9, -100, -100]
    (t=2 is its sample's last token; t+1=3 starts the next sample)."""
    out = torch.full_like(labels_BT, -100)
    same = position_ids_BT[:, 1:] == position_ids_BT[:, :-1] + 1
    out[:, :-1] = torch.where(same, labels_BT[:, 1:], torch.full_like(labels_BT[:, 1:], -100))
    return out


def mtp_ce_sum(head: MTPHead, target: nn.Module, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor,
               labels_BT: torch.Tensor, hidden_BTD: torch.Tensor, allowed_B1TT: torch.Tensor | None = None, *,
               detach_target: bool = False) -> torch.Tensor:
    """Σ over MTP targets (``mtp_labels``) of −log q(x_{t+2}); the head reads x_{t+1} and h_t. ``detach_target``:
    its gradient trains the head only (`MTPHead.logits`)."""
    next_ids_BT = torch.roll(input_ids_BT, -1, dims=1)  # the wrapped last column has label -100
    logits_BTV = head.logits(target, next_ids_BT, hidden_BTD, position_ids_BT, allowed_B1TT, detach_target=detach_target)
    tgt_BT = mtp_labels(labels_BT, position_ids_BT)
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), tgt_BT.flatten(), ignore_index=-100, reduction="sum")


def save_mtp(head: MTPHead, folder: str | Path) -> Path:
    """Write ``folder/mtp.safetensors``: the head's weights under ``mtp.`` and its config as metadata."""
    path = Path(folder) / MTP_FILE
    tensors = {_PREFIX + k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(path), metadata={"config": json.dumps(head.config.to_dict())})
    return path


def load_mtp(folder: str | Path) -> MTPHead | None:
    """The head saved in ``folder`` (``save_mtp``), or None when the folder has none."""
    path = Path(folder) / MTP_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{path}: no config in the metadata (not written by save_mtp)")
    head = MTPHead(LlamaConfig.from_dict(json.loads(meta["config"])))
    tensors = load_file(str(path))
    state = {k[len(_PREFIX):]: v for k, v in tensors.items() if k.startswith(_PREFIX)}
    head.load_state_dict(state, strict=True)
    return head.to(next(iter(state.values())).dtype)
