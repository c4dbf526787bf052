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
the rows whose chunks have the same length (every decode step is one forward): their caches
are left-padded to the longest into one ``DynamicCache``, a 2-D attention mask hides the
padding, each row gets its own position ids, and the grown layers are split back per slot.
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
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from k3post.routing_replay import RouteRecorder

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

    def as_hf(self, slots: list[int], lengths: list[int]) -> DynamicCache:
        """The first ``lengths[b]`` positions of slot ``slots[b]`` as one batched ``DynamicCache``,
        each row left-padded with zeros to the longest (empty when every length is 0)."""
        L = max(lengths)
        if L == 0:
            return DynamicCache()
        layers = []
        for li in range(self.num_layers):
            kv = []
            for store in (self.keys, self.values):
                t0 = store[slots[0]][li] if lengths[0] else next(store[s][li] for s, n in zip(slots, lengths) if n)
                out_BGLE = t0.new_zeros(len(slots), t0.shape[0], L, t0.shape[2])
                for b, (s, n) in enumerate(zip(slots, lengths)):
                    if n:
                        out_BGLE[b, :, L - n :] = store[s][li][:, :n]
                kv.append(out_BGLE)
            layers.append((kv[0], kv[1]))
        return DynamicCache(ddp_cache_data=layers)

    def store(self, slots: list[int], pads: list[int], cache: DynamicCache) -> None:
        """Take row b of every layer of ``cache``, without its ``pads[b]`` left-padding positions, as
        slot ``slots[b]``'s cache."""
        for b, (s, p) in enumerate(zip(slots, pads)):
            self.keys[s] = [layer.keys[b, :, p:] for layer in cache.layers]
            self.values[s] = [layer.values[b, :, p:] for layer in cache.layers]


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
        self.capture_layers: tuple[int, ...] = ()  # decoder layers whose output hidden states forward_chunks keeps
        self.captured: torch.Tensor | None = None  # [B, T, A, D] of the last forward_chunks (rows right-padded)
        self._out: torch.Tensor | None = None
        self.routes: RouteRecorder | None = None  # records each row's experts (routing replay) when set
        self.cache = SeqKVCache(self._probe(n_layers), num_slots, max_len, param.dtype, param.device)

    def _call(self, ids_BT: torch.Tensor, pos_BT: torch.Tensor, cache: DynamicCache,
              attn_BL: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """Logits [B, keep, V] of the last ``keep`` positions of each row; ``cache`` grows by T positions.
        ``attn_BL``: 1 on the real cached and new positions, 0 on left padding (None: no padding)."""
        kw: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kw["logits_to_keep"] = keep
        if attn_BL is not None:
            kw["attention_mask"] = attn_BL
        return self.model(input_ids=ids_BT, position_ids=pos_BT, **kw).logits[:, -keep:]

    def _probe(self, n_layers: int) -> list[KVShape]:
        """Read each layer's cached (heads, width) off a 2-token forward, then check that this path
        reproduces the model's full forward: a decode step of two rows at different positions (one
        left-padded) must give the logits of plain forwards of [0, 1, 2, 3] and [0, 1]."""
        param = next(self.model.parameters())
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                cache = DynamicCache()
                self._call(torch.tensor([[0, 1]], device=param.device), torch.arange(2, device=param.device)[None], cache)
                shapes = _layer_shapes(cache, n_layers, 2)
                self.cache = SeqKVCache(shapes, 2, 8, param.dtype, param.device)
                self.forward_chunks([[0, 1, 2]], [0], [0])
                self.forward_chunks([[0]], [0], [1])
                step_2V = self.forward_chunks([[3], [1]], [3, 1], [0, 1]).float()
                full_2V = torch.cat([self.model(input_ids=torch.tensor([ids], device=param.device), use_cache=False)
                                     .logits[:, -1] for ids in ([0, 1, 2, 3], [0, 1])]).float()
        finally:
            if was_training:
                self.model.train()
        err = (step_2V - full_2V).abs().max().item()
        rel = 1e-3 if param.dtype == torch.float32 else 5e-2  # a masking / cache bug is off by O(1)
        if not err <= rel * max(1.0, full_2V.abs().max().item()):
            raise ValueError(f"{type(self.model).__name__}: a batched decode step over its DynamicCache differs from "
                             f"the full forward by {err:.3g}: the embedded engine cannot run it")
        return shapes

    def forward_chunks(self, chunks: list[list[int]], starts: list[int], slots: list[int], *,
                       all_positions: bool = False) -> torch.Tensor:
        """Logits [B, V] of each chunk's last token; row b continues the cache of slot slots[b]
        (its first starts[b] positions), which then holds starts[b] + len(chunks[b]) positions.
        ``all_positions``: logits [B, T, V] of every position, rows right-padded (zeros) to the longest T.

        Rows with chunks of one length run as one batch (every decode step is one forward): their
        caches are left-padded to the longest start, an attention mask hides the padding, and the
        position ids are each row's own, so a row's numbers do not depend on its neighbours beyond
        fp32 rounding (within a row, cache index and position differ by a constant, which keeps
        sliding windows exact)."""
        groups: dict[int, list[int]] = {}
        for b, c in enumerate(chunks):
            groups.setdefault(len(c), []).append(b)
        T_max = max(groups)
        self.captured = None
        layers = self.model.get_decoder().layers if self.capture_layers else []
        grabbed: dict[int, torch.Tensor] = {}
        hooks = [layers[li].register_forward_hook(
            lambda _m, _i, out, li=li: grabbed.__setitem__(li, out[0] if isinstance(out, tuple) else out))
            for li in self.capture_layers]
        try:
            for T, rows in groups.items():
                self._forward_group(T, rows, chunks, starts, slots, all_positions, T_max, grabbed)
        finally:
            for h in hooks:
                h.remove()
        assert self._out is not None
        out_BV, self._out = self._out, None
        return out_BV

    def _forward_group(self, T: int, rows: list[int], chunks: list[list[int]], starts: list[int], slots: list[int],
                       all_positions: bool, T_max: int, grabbed: dict[int, torch.Tensor]) -> None:
        """``forward_chunks`` of the rows whose chunks have length T: writes their logits into ``self._out``
        (and their captured hidden states into ``self.captured``)."""
        dev = self.cache.device
        row_slots, row_starts = [slots[b] for b in rows], [starts[b] for b in rows]
        L = max(row_starts)
        self.cache.ensure_capacity(L + T)
        cache = self.cache.as_hf(row_slots, row_starts)
        ids_BT = torch.tensor([chunks[b] for b in rows], dtype=torch.long, device=dev)
        pos_BT = torch.tensor(row_starts, device=dev)[:, None] + torch.arange(T, device=dev)
        attn_BL = None
        if min(row_starts) < L:
            attn_BL = (torch.arange(L + T, device=dev)[None] >= (L - pos_BT[:, :1])).long()
        rec = nullcontext() if self.routes is None else self.routes.rows(
            torch.tensor(row_slots, device=dev).repeat_interleave(T), pos_BT.view(-1))
        with rec:
            logits_BTV = self._call(ids_BT, pos_BT, cache, attn_BL, T if all_positions else 1)
        self.cache.store(row_slots, [L - st for st in row_starts], cache)
        rows_R = torch.tensor(rows, device=dev)
        if self._out is None:  # [B, V], or [B, T_max, V] for all positions
            self._out = logits_BTV.new_zeros(len(chunks), *([T_max] if all_positions else []), logits_BTV.shape[-1])
        if all_positions:
            self._out[rows_R, :T] = logits_BTV
        else:
            self._out[rows_R] = logits_BTV[:, -1]
        if self.capture_layers:
            h_RTAD = torch.stack([grabbed[li] for li in self.capture_layers], dim=2)
            if self.captured is None:
                self.captured = h_RTAD.new_zeros(len(chunks), T_max, *h_RTAD.shape[2:])
            self.captured[rows_R, :T] = h_RTAD
