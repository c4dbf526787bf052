"""The external (CPU) KV-cache pool of partial rollout (SPEC §3.2).

Two tiers hold the KV cache of a paused trajectory:

1. **engine-resident**: ``engine.pause`` keeps the paused request's KV inside the engine
   (its active cache); resuming it (``engine.resume``) reuses it with no copy. The
   scheduler bounds the bytes left there (``resident_budget_bytes``).
2. **this pool**, on CPU: written **only when the KV is evicted from the engine**
   (write-back: the scheduler evicts the least recently paused resident KV when the
   resident budget is exceeded, ``engine.export_kv`` -> `KVPool.put`); LRU under
   ``budget_bytes``. On resume the entry is taken out (`KVPool.take`) and handed to the
   engine with the continuation request (prefetch: it is loaded into the slot at admission,
   skipping the prefill of the cached prefix). An entry the pool has dropped is a miss: the
   engine re-prefills the context, which gives the same tokens (counter-based sampling, the
   same weights).

`KVPool` is the second tier only: a byte-budgeted LRU map key -> `KVState` with hit / miss
/ eviction counters. It never holds an entry larger than its budget (such a put is dropped
and counted as an eviction), so ``budget_bytes=0`` forces every resume to re-prefill.

Shape legend: none (KV tensors are [kv_heads, N, head_dim] per layer, see `KVState`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from k3post.rollout.engine import KVState

__all__ = ["KVPool"]


class KVPool:
    """A CPU pool of `KVState` entries, LRU under a byte budget.

    Args:
        budget_bytes: most bytes held (sum of `KVState.nbytes`); 0 keeps nothing.

    Counters (``stats``): ``puts``, ``hits`` (take found it), ``misses`` (take did not),
    ``evictions`` (entries dropped for room, or too big to fit), ``discards`` (removed on
    purpose, e.g. stale weights), ``bytes`` (held now), ``peak_bytes``.
    """

    def __init__(self, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"KVPool budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, KVState] = OrderedDict()
        self.stats: dict[str, int] = {"puts": 0, "hits": 0, "misses": 0, "evictions": 0, "discards": 0, "bytes": 0, "peak_bytes": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self.stats["bytes"]

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def put(self, key: str, kv: KVState) -> bool:
        """Store ``kv`` (CPU tensors) under ``key`` as most recently used, evicting least
        recently used entries until it fits. Returns False when it cannot fit at all."""
        if not isinstance(kv, KVState):
            raise ValueError(f"KVPool.put takes a KVState, got {type(kv).__name__}")
        if any(t.device.type != "cpu" for t in kv.keys + kv.values):
            raise ValueError("KVPool holds CPU tensors only; export_kv returns them on CPU")
        self.discard(key, count=False)
        self.stats["puts"] += 1
        size = kv.nbytes
        if size > self.budget_bytes:
            self.stats["evictions"] += 1
            return False
        while self.stats["bytes"] + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.stats["bytes"] -= old.nbytes
            self.stats["evictions"] += 1
        self._entries[key] = kv
        self.stats["bytes"] += size
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self.stats["bytes"])
        return True

    def take(self, key: str) -> KVState | None:
        """Remove and return the entry for ``key`` (a hit), or None (a miss)."""
        kv = self._entries.pop(key, None)
        if kv is None:
            self.stats["misses"] += 1
            return None
        self.stats["bytes"] -= kv.nbytes
        self.stats["hits"] += 1
        return kv

    def peek_version(self, key: str) -> int | None:
        """The weight version of the entry for ``key`` (None when absent); no LRU update."""
        kv = self._entries.get(key)
        return None if kv is None else kv.weight_version

    def discard(self, key: str, *, count: bool = True) -> None:
        """Drop the entry for ``key`` if present."""
        kv = self._entries.pop(key, None)
        if kv is not None:
            self.stats["bytes"] -= kv.nbytes
            if count:
                self.stats["discards"] += 1

    def clear(self) -> None:
        """Drop every entry (counters kept)."""
        self._entries.clear()
        self.stats["bytes"] = 0

    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any take."""
        n = self.stats["hits"] + self.stats["misses"]
        return self.stats["hits"] / n if n else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Pool metadata (keys in LRU order, counters); the tensors are not saved: after a
        restart every resume is a miss and re-prefills, with identical tokens."""
        return {"budget_bytes": self.budget_bytes, "keys": self.keys(), "stats": dict(self.stats)}

    def tensor_state(self) -> list[dict[str, Any]]:
        """The entries themselves (tensors included), least recently used first, for a checkpoint
        that must resume exactly: a resumed paused trajectory then continues from the same KV
        (computed with older weights) instead of re-prefilling with the new ones. torch.save-able."""
        return [{"key": k, "keys": kv.keys, "values": kv.values, "context_ids": kv.context_ids,
                 "version": kv.weight_version, "oldest_version": kv.oldest_version} for k, kv in self._entries.items()]

    def load_tensor_state(self, saved: list[dict[str, Any]]) -> None:
        """Put back the entries of `tensor_state` in LRU order, without counting them as puts
        (call after `load_state_dict`, which restores the counters)."""
        self.clear()
        for e in saved:
            kv = KVState(list(e["keys"]), list(e["values"]), list(e["context_ids"]), int(e["version"]),
                         e.get("oldest_version"))  # older checkpoints: none saved, the newest version
            self._entries[str(e["key"])] = kv
            self.stats["bytes"] += kv.nbytes
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self.stats["bytes"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of `state_dict` (the pool starts empty: no tensors saved)."""
        self.clear()
        stats = dict(state.get("stats", {}))
        stats["bytes"] = 0
        self.stats.update({k: int(v) for k, v in stats.items() if k in self.stats})
