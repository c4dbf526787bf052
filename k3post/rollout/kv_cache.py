"""Static slot KV cache of the embedded engine.

One preallocated key and one value tensor per layer, ``[S, Hkv, C, Dh]``: S slots (the
engine's max batch size), C positions of capacity. Running sequences are kept compacted
in slots 0..n-1, so a decode step attends over the plain views ``keys[l][:n, :, :L]``
(no gather). When a sequence needs more positions, the capacity at least doubles (rounded up to a multiple of
``growth``, capped at ``max_len``), so memory follows the longest live sequence (within 2x) instead of ``max_len``
and a run re-allocates only a few times.

Shape legend:
    S   slots (max concurrent sequences)
    B   sequences in the current batch (B <= S)
    H   kv heads
    C   cache capacity (positions)
    T   new positions written at once
    N   positions of one exported sequence
    D   head dim
"""

from __future__ import annotations

import torch

__all__ = ["SlotKVCache"]


class SlotKVCache:
    """Per-layer ``[S, H, C, D]`` key / value tensors with growable capacity C."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 128,
        growth: int = 128,
    ) -> None:
        if min(num_layers, num_slots, num_kv_heads, head_dim, max_len, initial_capacity) < 1:
            raise ValueError("SlotKVCache sizes must all be >= 1")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        if growth < 1:
            raise ValueError("SlotKVCache growth must be >= 1")
        self.growth = growth
        self.capacity = min(initial_capacity, max_len)
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        self.keys: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._row_base_SH: torch.Tensor | None = None  # (s*H + h) * C, for step_index

    def shape_error(self, keys_HND: list[torch.Tensor], values_HND: list[torch.Tensor]) -> str | None:
        """Why a KV state (per layer [H, N, D] keys and values) does not fit this cache's model (None when it does)."""
        want = (self.num_kv_heads, self.head_dim)
        if len(keys_HND) == len(values_HND) == self.num_layers and all(
                k.dim() == v.dim() == 3 and (k.shape[0], k.shape[2]) == want == (v.shape[0], v.shape[2])
                for k, v in zip(keys_HND, values_HND)):
            return None
        got = f"{len(keys_HND)} x {tuple(keys_HND[0].shape)}" if keys_HND else "no layers"
        return f"shaped {got}, the model's {self.num_layers} layers x [{self.num_kv_heads}, N, {self.head_dim}]"

    @property
    def nbytes(self) -> int:
        """Bytes held by all key and value tensors."""
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)

    def ensure_capacity(self, needed: int) -> None:
        """Grow C so that ``needed`` positions fit: C' = max(needed, 2C) rounded up to a multiple of
        ``growth``, capped at max_len; the cached positions are copied over."""
        if needed > self.max_len:
            raise ValueError(f"a sequence needs {needed} cached positions but max_model_len is {self.max_len}")
        if needed <= self.capacity:
            return
        new_cap = -(-max(needed, 2 * self.capacity) // self.growth) * self.growth  # at least double: few re-allocations
        new_cap = min(new_cap, self.max_len)
        for store in (self.keys, self.values):
            for i, old_SHCD in enumerate(store):
                new_SHCD = torch.zeros(
                    (self.num_slots, self.num_kv_heads, new_cap, self.head_dim), dtype=self.dtype, device=self.device
                )
                new_SHCD[:, :, : self.capacity] = old_SHCD
                store[i] = new_SHCD
        self.capacity = new_cap
        self._row_base_SH = None

    def step_index(self, pos_B: torch.Tensor, slots_B: torch.Tensor | None = None) -> torch.Tensor:
        """Row indices into the flattened [S*H*C, D] cache for writing position ``pos_B[b]``
        of slot b (b = 0..B-1; slot ``slots_B[b]`` when given), for every kv head: [B*H],
        ordered (b, h), i.e. ``(b*H + h)*C + pos_B[b]``. With T positions per slot (``pos_B``
        [B, T]): [B*T*H], ordered (b, t, h). Valid until the capacity changes; compute once
        per decode step, reuse per layer."""
        B = pos_B.shape[0]
        if self._row_base_SH is None:
            self._row_base_SH = (
                torch.arange(self.num_slots * self.num_kv_heads, device=self.device) * self.capacity
            ).view(self.num_slots, self.num_kv_heads)
        base_BH = self._row_base_SH[:B] if slots_B is None else self._row_base_SH[slots_B]
        if pos_B.dim() == 2:
            return (base_BH[:, None, :] + pos_B[:, :, None]).view(-1)
        return (base_BH + pos_B[:, None]).view(-1)

    def write_step(self, layer: int, index_BH: torch.Tensor, k_BHD: torch.Tensor, v_BHD: torch.Tensor) -> None:
        """Write the positions ``index_BH`` names (from ``step_index``; k / v rows in its order)."""
        D = self.head_dim
        self.keys[layer].view(-1, D).index_copy_(0, index_BH, k_BHD.reshape(-1, D))
        self.values[layer].view(-1, D).index_copy_(0, index_BH, v_BHD.reshape(-1, D))

    def write_block(self, layer: int, slot: int, start: int, k_HTD: torch.Tensor, v_HTD: torch.Tensor) -> None:
        """Write T consecutive positions start..start+T-1 of one slot."""
        T = k_HTD.shape[1]
        self.keys[layer][slot, :, start : start + T] = k_HTD
        self.values[layer][slot, :, start : start + T] = v_HTD

    def view(self, layer: int, n_slots: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots 0..n_slots-1, positions 0..length-1: [B, H, L, D] views."""
        return self.keys[layer][:n_slots, :, :length], self.values[layer][:n_slots, :, :length]

    def gather(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots, positions 0..length-1: [B, H, L, D] (views when
        the slots are consecutive and ascending, else copies)."""
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):
            return self.keys[layer][s0 : s0 + len(slots), :, :length], self.values[layer][s0 : s0 + len(slots), :, :length]
        idx_B = torch.tensor(slots, dtype=torch.long, device=self.device)
        return (
            self.keys[layer][:, :, :length].index_select(0, idx_B),
            self.values[layer][:, :, :length].index_select(0, idx_B),
        )

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length == 0:
            return
        for store in (self.keys, self.values):
            for t_SHCD in store:
                t_SHCD[dst, :, :length] = t_SHCD[src, :, :length]

    def export(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first ``length`` positions of one slot on CPU: per layer [H, N, D]."""
        keys = [k[slot, :, :length].to("cpu", copy=True) for k in self.keys]
        values = [v[slot, :, :length].to("cpu", copy=True) for v in self.values]
        return keys, values

    def load(self, slot: int, keys_HND: list[torch.Tensor], values_HND: list[torch.Tensor]) -> None:
        """Write an exported sequence's cache into ``slot`` (positions 0..N-1)."""
        if len(keys_HND) != self.num_layers or len(values_HND) != self.num_layers:
            raise ValueError(f"KV state has {len(keys_HND)} layers, the model has {self.num_layers}")
        n = keys_HND[0].shape[1]
        self.ensure_capacity(n)
        for layer, (k_HND, v_HND) in enumerate(zip(keys_HND, values_HND)):
            if k_HND.shape != (self.num_kv_heads, n, self.head_dim):
                raise ValueError(
                    f"KV state layer {layer} has shape {tuple(k_HND.shape)}, expected "
                    f"[{self.num_kv_heads}, {n}, {self.head_dim}]"
                )
            self.write_block(
                layer, slot, 0, k_HND.to(self.device, self.dtype), v_HND.to(self.device, self.dtype)
            )
