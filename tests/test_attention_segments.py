"""Tests of k3post.rollout.segments (contiguous row ranges for ragged decode attention).

Hand-derived golden partitions, a brute-force check over every partition, and the engine:
a decode batch of one long and several short contexts is split, and each request's tokens
and log-probs equal those of the request decoded alone.

Shape legend: none (lists of ints).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3post.rollout.segments import attention_segments


def _cost(segs: list[tuple[int, int, int]], c: int) -> int:
    return sum(c + (b - a) * length for a, b, length in segs)


def test_golden_partitions():
    # no padding at all: one call
    assert attention_segments([10, 10, 10, 10], 5) == [(0, 4, 10)]
    # one long row first: one call = 5 + 4 * 1000 = 4005; [0,1) + [1,4) = (5 + 1000) + (5 + 3 * 10) = 1040;
    # three calls [0,1) [1,2) [2,4) = 1005 + 15 + 25 = 1045 > 1040
    assert attention_segments([1000, 10, 10, 10], 5) == [(0, 1, 1000), (1, 4, 10)]
    # long rows interleaved: one call per row = 1005 + 15 + 1005 + 15 = 2040; the best two-call split
    # [0,3) [3,4) = 3005 + 15 = 3020; one call 4005
    assert attention_segments([1000, 10, 1000, 10], 5) == [(0, 1, 1000), (1, 2, 10), (2, 3, 1000), (3, 4, 10)]
    # the same rows with a costly call: all the padding, 4 * 1000 - 2020 = 1980, is worth less than one call
    assert attention_segments([1000, 10, 1000, 10], 3000) == [(0, 4, 1000)]
    # a split in the middle: one call 50 + 6 * 100 = 650; [0,2) [2,6) = 250 + 90 = 340;
    # [0,2) [2,4) [4,6) = 250 + 70 + 70 = 390; [0,1) [1,2) [2,6) = 150 + 150 + 90 = 390
    assert attention_segments([100, 100, 10, 10, 10, 10], 50) == [(0, 2, 100), (2, 6, 10)]
    # free calls: each row alone (ties are broken toward the longer last range; here none)
    assert attention_segments([3, 1, 2], 0) == [(0, 1, 3), (1, 2, 1), (2, 3, 2)]
    assert attention_segments([7], 1024) == [(0, 1, 7)]


def test_validation():
    with pytest.raises(ValueError, match="at least one row"):
        attention_segments([])
    with pytest.raises(ValueError, match="call_positions"):
        attention_segments([1, 2], -1)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=8), c=st.integers(0, 400))
def test_optimal_over_every_partition(lengths, c):
    """The partition covers rows 0..B-1 in order, each range's length is its longest row, and
    no partition (all 2^(B-1) sets of split points) costs less."""
    segs = attention_segments(lengths, c)
    assert segs[0][0] == 0 and segs[-1][1] == len(lengths)
    assert all(a < b for a, b, _ in segs) and all(s[1] == t[0] for s, t in zip(segs, segs[1:]))
    assert all(length == max(lengths[a:b]) for a, b, length in segs)
    B = len(lengths)
    best = min(
        _cost([(a, b, max(lengths[a:b])) for a, b in zip((0, *cuts), (*cuts, B))], c)
        for r in range(B)
        for cuts in itertools.combinations(range(1, B), r)
    )
    assert _cost(segs, c) == best


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("qat", [False, True])  # QAT on: the engine's exact (SDPA, boolean mask) path
def test_engine_decodes_ragged_batch_in_segments_with_solo_results(qat):
    """One long context (1,200 positions) ahead of three short ones (10): padding them all to
    the long one would waste 3 x 1,190 row-positions > one call, so each decode step attends
    in two ranges (the long row alone, then the short rows over their own ~10 positions), and
    every request samples what it samples alone."""
    from k3post.models import build_tiny_moe
    from k3post.quant.qat import QATConfig, apply_qat
    from k3post.rollout import EmbeddedEngine, GenerationRequest, SamplingParams

    model = build_tiny_moe(300, seed=0).eval()
    if qat:
        apply_qat(model, QATConfig())
    sp = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=s) for s in range(4)]
    reqs = [GenerationRequest("long", [(7 * i) % 290 + 5 for i in range(1200)], sp[0])] + [
        GenerationRequest(f"short{j}", [(11 * i + j) % 290 + 5 for i in range(10)], sp[j]) for j in (1, 2, 3)
    ]
    engine = EmbeddedEngine(model, max_batch_size=4)
    seen: list[int] = []
    attend_step = engine._lean.attend_step

    def spy(w, q, k, v, mask):  # records the key length of every decode attention call
        seen.append(k.shape[-2])
        return attend_step(w, q, k, v, mask)

    engine._lean.attend_step = spy  # type: ignore[method-assign]
    together = engine.generate(reqs)
    assert attention_segments([1201, 11, 11, 11]) == [(0, 1, 1201), (1, 4, 11)]
    assert seen and min(seen) <= 16 and max(seen) >= 1201  # short rows never padded to the long one
    for r, got in zip(reqs, together):
        alone = EmbeddedEngine(model, max_batch_size=1).generate([r])[0]
        assert got.output_ids == alone.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, alone.output_logprobs)) < 1e-5


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=14), c=st.integers(0, 400),
       max_blocks=st.integers(1, 5))
def test_blocked_optimal_over_every_block_aligned_partition(lengths, c, max_blocks):
    """Above ``max_blocks`` rows the ranges start at multiples of g = ceil(B / max_blocks): the result is
    such a partition and no other (every set of block-aligned split points) costs less."""
    B = len(lengths)
    g = -(-B // max_blocks)
    segs = attention_segments(lengths, c, max_blocks)
    assert segs[0][0] == 0 and segs[-1][1] == B
    assert all(a < b for a, b, _ in segs) and all(s[1] == t[0] for s, t in zip(segs, segs[1:]))
    assert all(length == max(lengths[a:b]) for a, b, length in segs)
    assert all(a % g == 0 for a, _, _ in segs) or segs == [(0, B, max(lengths))]
    cut_points = range(g, B, g)
    best = min(
        _cost([(a, b, max(lengths[a:b])) for a, b in zip((0, *cuts), (*cuts, B))], c)
        for r in range(len(cut_points) + 1)
        for cuts in itertools.combinations(cut_points, r)
    )
    assert _cost(segs, c) == best


def test_blocked_keeps_a_long_row_apart_at_256_rows():
    """The engine's 256-slot batch: one resumed long context among short ones is still split off (to
    within its block of 8 rows), instead of padding 255 short rows to it."""
    lengths = [70 + (7 * i) % 60 for i in range(256)]
    lengths[100] = 1500
    segs = attention_segments(lengths)
    long_range = [s for s in segs if s[2] == 1500]
    assert len(long_range) == 1 and long_range[0][:2] == (96, 104)
    assert sum(b - a for a, b, _ in segs) == 256 and max(n for _, _, n in segs if n != 1500) < 130
    with pytest.raises(ValueError, match="max_blocks"):
        attention_segments([1, 2], 5, 0)
