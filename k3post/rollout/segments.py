"""Split a decode batch into contiguous slot ranges for attention (ragged lengths without padding).

A decode step attends each running row b (slots 0..B-1 of the slot KV cache) over its own
``l_b`` cached positions. One SDPA call over all rows pads every row to ``max_b l_b``, so a
few long contexts (a paused long trajectory resumed next to fresh short ones, the usual
batch of partial rollout) make every short row pay for the longest one. Splitting the rows
into contiguous ranges s = [a, b) (views of the cache, no copy) costs

    cost(partition) = sum_s ( c + (b_s - a_s) * max_{a_s <= i < b_s} l_i )

where ``c`` is the fixed cost of one attention call in row-positions (launch, views, mask
slice; about 1,000 positions of a decode SDPA on one CPU core). `attention_segments`
returns the partition of least cost (exact dynamic programme over the split points,
O(B^2)); when all the padding together is not worth one extra call it returns the single
range at once (O(B)). The result per row does not depend on the partition (masked keys
get zero weight), only the work does.

Shape legend: none (lists of ints).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SEGMENT_CALL_POSITIONS", "attention_segments"]

SEGMENT_CALL_POSITIONS = 1024
"""Default ``call_positions``: one extra attention call costs about as much as this many row-positions."""


def attention_segments(lengths: Sequence[int], call_positions: int = SEGMENT_CALL_POSITIONS) -> list[tuple[int, int, int]]:
    """Contiguous row ranges ``(start, end, length)`` covering rows 0..B-1 in order, where
    ``length`` is the longest ``lengths[i]`` of the range, minimising
    ``sum(call_positions + (end - start) * length)`` (module doc).

    Args:
        lengths: attended positions of each row (>= 1), in slot order.
        call_positions: fixed cost of one attention call, in row-positions (>= 0).
    """
    if not lengths:
        raise ValueError("attention_segments needs at least one row")
    if call_positions < 0:
        raise ValueError(f"call_positions must be >= 0, got {call_positions}")
    B = len(lengths)
    longest = max(lengths)
    if B * longest - sum(lengths) <= call_positions:  # no split can pay for its extra call
        return [(0, B, longest)]
    best = [0] * (B + 1)  # best[j]: least cost of rows 0..j-1
    start = [0] * (B + 1)  # start[j]: first row of the last range in that optimum
    for j in range(1, B + 1):
        m = 0
        best_j = -1
        for i in range(j - 1, -1, -1):  # last range = rows i..j-1, its max grows as i falls
            m = max(m, lengths[i])
            c = best[i] + call_positions + (j - i) * m
            if best_j < 0 or c < best_j:
                best_j, start[j] = c, i
        best[j] = best_j
    out = []
    j = B
    while j > 0:
        i = start[j]
        out.append((i, j, max(lengths[i:j])))
        j = i
    return out[::-1]
