"""Hypothesis strategies for XTML conversations, shared by tests/test_xtml.py and tests/test_fuzz_xtml.py:
text that often spells special tokens, quotes, backslashes and split multi-byte characters; JSON
argument values; assistant messages with tool calls; whole conversations with tool results.

Shape legend: none.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

# Text that often spells special tokens, quotes, backslashes and split multi-byte chars.
texts = st.lists(
    st.one_of(st.text(max_size=10), st.sampled_from([O, C, S, E, "<|pad|>", '"', "\\", "𝄞", "ꙮ", "\n"])),
    max_size=4,
).map("".join)
json_leaf = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False) | texts
json_value = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
    max_leaves=6,
)
call_args = st.dictionaries(texts, json_value, max_size=4)
tool_call = st.builds(
    lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}},
    texts.filter(bool),
    call_args,
)
assistant_msg = st.builds(
    lambda r, c, calls: {"role": "assistant", "reasoning_content": r, "content": c, "tool_calls": calls},
    texts,
    texts,
    st.lists(tool_call, max_size=3),
)


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(1, 3))):
        name = {"name": draw(texts)} if draw(st.booleans()) else {}
        msgs.append({"role": "user", "content": draw(texts), **name})
        a = draw(assistant_msg)
        msgs.append(a)
        for k in range(len(a["tool_calls"])):
            if draw(st.booleans()):
                msgs.append({"role": "tool", "index": k + 1, "content": draw(texts)})
    return msgs
