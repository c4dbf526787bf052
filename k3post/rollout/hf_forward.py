"""The general forward of the embedded engine: the model's own forward over an HF KV cache.

``EmbeddedEngine`` runs this path for every causal LM its lean forward cannot reproduce
exactly (sliding-window layers, attention sinks, MLA, biased or grouped routers, shared
experts, ...: `k3post.rollout.embedded.lean_blocker` says why). Each forward calls
``model(input_ids, position_ids, cache=DynamicCache(...), logits_to_keep=1)``, so the
numbers are the model's own: a cached decode step differs from a teacher-forced forward of
the whole sequence only by fp32 rounding (~1e-6 in log-probs, tested per family).

The cache is per sequence (``SeqKVCache``): for each slot, per layer, the key and value
tensors the model's ``DynamicLayer`` holds for it, whatever their widths (MLA caches its
compressed latent and the shared rotary key instead of per-head K / V). A forward batches
the rows that sit at the same position with chunks of the same length (the K samples of
one prompt decode in lockstep): their caches are stacked into one ``DynamicCache``, so no
padding and no attention mask are needed, and the grown layers are split back per slot.
Sliding-window layers keep every position (a full ``DynamicLayer``) and the model's own
mask hides the ones outside the window, so the cache exports and imports like any other.

Shape legend:
    B   rows in one forward (same start, same chunk length)
    T   new positions per row
    N   cached positions of a sequence
    G   cached heads of a layer (1 for MLA latents)
    E   width of a cached entry (head dim; MLA: the latent rank / the rotary width)
    V   vocabulary size
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

__all__ = ["HFForward", "SeqKVCache"]

KVShape = tuple[tuple[int, int], tuple[int, int]]
"""(G, E) of a layer's keys and of its values."""


class SeqKVCache:
    """Per-slot key / value tensors [G, N, E] per layer (the general path's cache).

    The subset of ``SlotKVCache``'s interface the engine's scheduling uses: ``copy_slot``,
    ``export``, ``load``, ``ensure_capacity``, ``nbytes``. Slots share tensors where they
    can: a copy is a view (``DynamicLayer.update`` concatenates into new tensors, never
    writes in place)."""

    def __init__(self, shapes: list[KVShape], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shapes = shapes
        self.num_layers = len(shapes)
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached positions of every slot (a view shared by two slots counts twice)."""
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for slot in store for t in slot)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"a sequence needs {needed} cached positions but max_model_len is {self.max_len}")

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` holds the first ``length`` positions of slot ``src`` (views)."""
        if src == dst:
            return
        self.keys[dst] = [k[:, :length] for k in self.keys[src]]
        self.values[dst] = [v[:, :length] for v in self.values[src]]

    def export(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first ``length`` positions of one slot on CPU: per layer [G, N, E]."""
        return ([k[:, :length].to("cpu", copy=True) for k in self.keys[slot]],
                [v[:, :length].to("cpu", copy=True) for v in self.values[slot]])

    def load(self, slot: int, keys_GNE: list[torch.Tensor], values_GNE: list[torch.Tensor]) -> None:
        """Put an exported sequence's cache into ``slot``."""
        if (len(keys_GNE), len(values_GNE)) != (self.num_layers, self.num_layers):
            raise ValueError(f"KV state has {len(keys_GNE)} layers, the model has {self.num_layers}")
        self.ensure_capacity(keys_GNE[0].shape[1])
        self.keys[slot] = [k.to(self.device, self.dtype) for k in keys_GNE]
        self.values[slot] = [v.to(self.device, self.dtype) for v in values_GNE]

    def shape_error(self, keys_GNE: list[torch.Tensor], values_GNE: list[torch.Tensor]) -> str | None:
        """Why a KV state does not fit this model (None when it does)."""
        got = [((k.shape[0], k.shape[2]), (v.shape[0], v.shape[2])) for k, v in zip(keys_GNE, values_GNE)]
        if got != self.shapes:
            return f"per-layer (keys, values) (heads, width) {got[:2]}... expected {self.shapes[:2]}..."
        return None

    def as_hf(self, slots: list[int], length: int) -> DynamicCache:
        """The first ``length`` positions of ``slots`` as one batched ``DynamicCache`` (empty for 0)."""
        if length == 0:
            return DynamicCache()
        return DynamicCache(ddp_cache_data=[
            (torch.stack([self.keys[s][li][:, :length] for s in slots]),
             torch.stack([self.values[s][li][:, :length] for s in slots]))
            for li in range(self.num_layers)
        ])

    def store(self, slots: list[int], cache: DynamicCache) -> None:
        """Take row b of every layer of ``cache`` as slot ``slots[b]``'s cache."""
        for b, s in enumerate(slots):
            self.keys[s] = [layer.keys[b] for layer in cache.layers]
            self.values[s] = [layer.values[b] for layer in cache.layers]


def _layer_shapes(cache: DynamicCache, n_layers: int, n_tokens: int) -> list[KVShape]:
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != n_layers or not all(
        isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
        and layer.keys.shape[2] == n_tokens and layer.values.shape[2] == n_tokens for layer in layers
    ):
        raise ValueError("the model's forward does not fill a DynamicCache with one [B, heads, T, width] key and value "
                         "per layer (a recurrent or hybrid cache?): the embedded engine cannot run it")
    return [((int(x.keys.shape[1]), int(x.keys.shape[3])), (int(x.values.shape[1]), int(x.values.shape[3])))
            for x in layers]


class HFForward:
    """Forwards of token chunks through ``model`` itself, each row continuing its slot's cache."""

    def __init__(self, model: nn.Module, num_slots: int, max_len: int) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        param = next(model.parameters())
        n_layers = int(getattr(model.config.get_text_config(decoder=True), "num_hidden_layers"))
        self.cache = SeqKVCache(self._probe(n_layers), num_slots, max_len, param.dtype, param.device)

    def _call(self, ids_BT: torch.Tensor, pos_BT: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Logits [B, V] of the last position of each row; ``cache`` grows by T positions."""
        kw: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kw["logits_to_keep"] = 1
        return self.model(input_ids=ids_BT, position_ids=pos_BT, **kw).logits[:, -1]

    def _probe(self, n_layers: int) -> list[KVShape]:
        """Check that decoding over the cache reproduces the full forward (3 tokens: 2 prefilled,
        1 decoded), and read each layer's cached (heads, width)."""
        dev = next(self.model.parameters()).device
        ids_13 = torch.tensor([[0, 1, 2]], device=dev)
        pos_13 = torch.arange(3, device=dev)[None]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                cache = DynamicCache()
                self._call(ids_13[:, :2], pos_13[:, :2], cache)
                shapes = _layer_shapes(cache, n_layers, 2)
                step_1V = self._call(ids_13[:, 2:], pos_13[:, 2:], cache)
                full_1V = self.model(input_ids=ids_13, position_ids=pos_13, use_cache=False).logits[:, -1]
        finally:
            if was_training:
                self.model.train()
        err = (step_1V.float() - full_1V.float()).abs().max().item()
        if not err <= 1e-3 * max(1.0, full_1V.float().abs().max().item()):
            raise ValueError(f"{type(self.model).__name__}: a decode step over its DynamicCache differs from the full "
                             f"forward by {err:.3g}: the embedded engine cannot run it")
        return shapes

    def forward_chunks(self, chunks: list[list[int]], starts: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [B, V] of each chunk's last token; row b continues the cache of slot slots[b]
        (its first starts[b] positions), which then holds starts[b] + len(chunks[b]) positions."""
        dev = self.cache.device
        groups: dict[tuple[int, int], list[int]] = {}
        for b, (c, st) in enumerate(zip(chunks, starts)):
            groups.setdefault((st, len(c)), []).append(b)
        out_BV: torch.Tensor | None = None
        for (start, T), rows in groups.items():
            self.cache.ensure_capacity(start + T)
            row_slots = [slots[b] for b in rows]
            cache = self.cache.as_hf(row_slots, start)
            ids_BT = torch.tensor([chunks[b] for b in rows], dtype=torch.long, device=dev)
            pos_BT = torch.arange(start, start + T, device=dev).expand(len(rows), T)
            logits_BV = self._call(ids_BT, pos_BT, cache)
            self.cache.store(row_slots, cache)
            if out_BV is None:
                out_BV = logits_BV.new_empty(len(chunks), logits_BV.shape[-1])
            out_BV[torch.tensor(rows, device=dev)] = logits_BV
        assert out_BV is not None
        return out_BV
