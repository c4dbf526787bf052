"""Tests of k3post.rollout.kv_cache.SlotKVCache: the decode-step write index (golden),
indexed writes and views, geometric capacity growth (golden), gather as views or copies,
slot copies and export / load.

Shape legend: S slots, H kv heads, C capacity, D head dim, B batch rows, L positions.
"""

from __future__ import annotations

import pytest
import torch

from k3post.rollout.kv_cache import SlotKVCache


def _cache(**kw) -> SlotKVCache:
    args = dict(num_layers=2, num_slots=4, num_kv_heads=2, head_dim=3, max_len=40, dtype=torch.float32,
                device=torch.device("cpu"), initial_capacity=8, growth=4)
    args.update(kw)
    return SlotKVCache(**args)  # type: ignore[arg-type]


def test_step_index_golden_and_write_step():
    c = _cache()
    # row of (slot b, head h, position p) in the flattened [S*H*C, D] cache: (b*H + h)*C + p, C = 8, H = 2
    # b=0 at p=5: 5, 13; b=1 at p=2: (2+0)*8+2 = 18, (2+1)*8+2 = 26; b=2 at p=7: 39, 47
    pos_B = torch.tensor([5, 2, 7])
    assert c.step_index(pos_B).tolist() == [5, 13, 18, 26, 39, 47]
    k_BHD = torch.arange(18, dtype=torch.float32).view(3, 2, 3)
    c.write_step(1, c.step_index(pos_B), k_BHD, -k_BHD)
    for b, p in enumerate([5, 2, 7]):
        assert torch.equal(c.keys[1][b, :, p], k_BHD[b]) and torch.equal(c.values[1][b, :, p], -k_BHD[b])
    assert c.keys[0].abs().sum() == 0 and c.keys[1].abs().sum() == k_BHD.abs().sum()  # nothing else written
    # a non-contiguous source (a slice of a wider block, as the engine passes k) writes the same
    wide_BND = torch.zeros(3, 5, 3)
    wide_BND[:, 3:] = k_BHD + 100
    c.write_step(0, c.step_index(pos_B), wide_BND[:, 3:], wide_BND[:, 3:])
    assert torch.equal(c.keys[0][1, :, 2], k_BHD[1] + 100)


def test_capacity_growth_golden():
    c = _cache()
    c.keys[0][3, 1, 7, 0] = 1.5
    c.ensure_capacity(8)  # fits: unchanged
    assert c.capacity == 8
    c.ensure_capacity(9)  # max(9, 2*8) = 16, a multiple of growth 4
    assert c.capacity == 16 and c.keys[0].shape == (4, 2, 16, 3) and c.keys[0][3, 1, 7, 0] == 1.5
    assert c.step_index(torch.tensor([0])).tolist() == [0, 16]  # index base follows the new capacity
    c.ensure_capacity(35)  # max(35, 32) = 35 -> 36
    assert c.capacity == 36
    c.ensure_capacity(37)  # max(37, 72) = 72 -> capped at max_len 40
    assert c.capacity == 40 and c.keys[1][3, 1, 7, 0] == 0 and c.keys[0][3, 1, 7, 0] == 1.5
    assert c.nbytes == 2 * 2 * 4 * 2 * 40 * 3 * 4
    with pytest.raises(ValueError, match="max_model_len"):
        c.ensure_capacity(41)


def test_gather_views_consecutive_slots_copies_others():
    c = _cache()
    c.keys[0].copy_(torch.randn(4, 2, 8, 3))
    k, v = c.gather(0, [1, 2], 5)
    assert k._base is not None and k.data_ptr() == c.keys[0][1].data_ptr()  # a view, no copy
    assert torch.equal(k, c.keys[0][1:3, :, :5]) and v.shape == (2, 2, 5, 3)
    k2, _ = c.gather(0, [2, 0], 5)
    assert torch.equal(k2[0], c.keys[0][2, :, :5]) and torch.equal(k2[1], c.keys[0][0, :, :5])
    k2.zero_()  # a copy: the cache is untouched
    assert c.keys[0][2].abs().sum() > 0


def test_copy_slot_export_load_roundtrip():
    c = _cache()
    for t in c.keys + c.values:
        t.copy_(torch.randn_like(t))
    c.copy_slot(3, 1, 6)
    assert torch.equal(c.keys[1][1, :, :6], c.keys[1][3, :, :6]) and not torch.equal(c.keys[1][1, :, 6:], c.keys[1][3, :, 6:])
    keys, values = c.export(1, 6)
    assert [k.shape for k in keys] == [(2, 6, 3)] * 2
    d = _cache()
    d.load(2, keys, values)
    assert torch.equal(d.keys[0][2, :, :6], c.keys[0][1, :, :6]) and torch.equal(d.values[1][2, :, :6], c.values[1][1, :, :6])
    with pytest.raises(ValueError, match="layers"):
        d.load(0, keys[:1], values[:1])
