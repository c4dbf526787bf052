"""Split a decode batch into contiguous slot ranges for attention (ragged lengths without padding).

A decode step attends each running row b (slots 0..B-1 of the slot KV cache) over its own
``l_b`` cached positions. One SDPA call over all rows pads every row to ``max_b l_b``, so a
few long contexts (a paused long trajectory resumed next to fresh short ones, the usual
batch of partial rollout) make every short row pay for the longest one. Splitting the rows
into contiguous ranges s = [a, b) (views of the cache, no copy) costs

    cost(partition) = sum_s ( c + (b_s - a_s) * max_{a_s <= i < b_s} l_i )

where ``c`` is the fixed cost of one attention call in row-positions (launch, views, mask
slice; about 1,000 positions of a decode SDPA on one CPU core). `attention_segments`
returns the partition of least cost by a dynamic programme over the split points; when all
the padding together is not worth one extra call it returns the single range at once (O(B)).
Above ``max_blocks`` rows (32) the split points are restricted to multiples of
``g = ceil(B / max_blocks)`` rows: the programme's O(B^2) Python steps cost ~8 ms a decode step
at the 256 slots general's engines run, more than the attention it saved (an avg@4 evaluation
of 200 tasks 5.7 -> 5.1 s; docs/decisions.md, issue 32 §segments), while the blocked one takes
~0.1 ms and keeps the point of the split (a paused long context does not pad the short rows
beside it, to within g rows). The result per row does not depend on the partition (masked
keys get zero weight), only the work does, up to floating-point rounding.

Shape legend: none (lists of ints).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SEGMENT_CALL_POSITIONS", "SEGMENT_MAX_BLOCKS", "attention_segments"]

SEGMENT_CALL_POSITIONS = 1024
"""Default ``call_positions``: one extra attention call costs about as much as this many row-positions."""

SEGMENT_MAX_BLOCKS = 32
"""Default ``max_blocks``: above this many rows, ranges start at multiples of ceil(B / max_blocks) rows."""


def attention_segments(
    lengths: Sequence[int], call_positions: int = SEGMENT_CALL_POSITIONS, max_blocks: int = SEGMENT_MAX_BLOCKS,
) -> list[tuple[int, int, int]]:
    """Contiguous row ranges ``(start, end, length)`` covering rows 0..B-1 in order, where
    ``length`` is the longest ``lengths[i]`` of the range, minimising
    ``sum(call_positions + (end - start) * length)`` over the partitions whose ranges start at
    multiples of ``g = ceil(B / max_blocks)`` (every partition when B <= max_blocks; module doc).

    Args:
        lengths: attended positions of each row (>= 1), in slot order.
        call_positions: fixed cost of one attention call, in row-positions (>= 0).
        max_blocks: most candidate ranges' starts the programme weighs (>= 1).
    """
    if not lengths:
        raise ValueError("attention_segments needs at least one row")
    if call_positions < 0:
        raise ValueError(f"call_positions must be >= 0, got {call_positions}")
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    B = len(lengths)
    longest = max(lengths)
    if B * longest - sum(lengths) <= call_positions:  # no split can pay for its extra call
        return [(0, B, longest)]
    g = -(-B // max_blocks)  # rows per block
    edges = list(range(0, B, g)) + [B]  # block k = rows edges[k]..edges[k+1]-1
    block_max = [max(lengths[a:b]) for a, b in zip(edges, edges[1:])]
    nb = len(block_max)
    best = [0] * (nb + 1)  # best[j]: least cost of blocks 0..j-1
    start = [0] * (nb + 1)  # start[j]: first block of the last range in that optimum
    for j in range(1, nb + 1):
        m = 0
        best_j = -1
        for i in range(j - 1, -1, -1):  # last range = blocks i..j-1, its max grows as i falls
            if block_max[i] > m:
                m = block_max[i]
            c = best[i] + call_positions + (edges[j] - edges[i]) * m
            if best_j < 0 or c < best_j:
                best_j, start[j] = c, i
        best[j] = best_j
    out = []
    j = nb
    while j > 0:
        i = start[j]
        out.append((edges[i], edges[j], max(block_max[i:j])))
        j = i
    return out[::-1]
