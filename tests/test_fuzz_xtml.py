"""Fuzzing the XTML parser (`XTML.parse`), the stream parser (`XTML.stream`) and `XTML.validate` (issue 20).

Inputs: arbitrary token-id sequences (any id of the vocabulary, ids outside it, and runs built from
special tokens, header texts and argument bodies so the fuzzer reaches deep structure), arbitrary text
tokenized with its special tokens, valid renders with every special token inserted at / swapped into
every position, and render -> parse round trips of generated conversations (tests/xtml_strategies.py).

Properties, for every input:
- `parse` returns a message or raises `XTMLParseError` (the documented type) at a position in
  ``[0, len(ids)]``; `validate` never raises and agrees with `parse` on completions;
- the stream parser, fed token by token, fails at the same token with the same message, or ends with
  the same message as `parse(after_prefix=True)`, its text deltas adding up to the channel texts;
- the first error does not depend on later tokens: the prefix before it validates (``partial=True``);
- each case finishes within a time bound (hypothesis ``deadline``), and long degenerate streams
  (bytes that never form a character) take linear time.

The default run keeps the budget small (~200 examples a property); ``-m slow`` runs a larger one.

Shape legend: none (token lists only).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast
from xtml_strategies import C, E, O, S, conversations

from k3post.tokenizer import encode_text
from k3post.xtml import XTML, ChannelClose, MessageEnd, TextDelta, XTMLParseError

FAST = settings(max_examples=200, deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=3000, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])

# Header texts and bodies that make structure: with the special tokens around them the fuzzer reaches
# channels, calls, arguments, tool results and option messages, valid and nearly valid.
FRAGMENTS = [
    'message role="assistant"', 'message role="user"', 'message role="system"', 'message role="tool" tool="f" index="1"',
    'message role="system" type="tool-declare"', 'message role="robot"', "message", "think", "response", "tools",
    'call tool="f" index="1"', 'call tool="f" index="2"', 'call tool="" index="1"', "call",
    'argument key="a" type="number"', 'argument key="a" type="string"', 'argument key="b" type="object"',
    'argument key="a" type="banana"', "argument", 'json type="object"', 'json type="array"', "json",
    '"x"', "12", "1e999", "{}", "[1]", "true", "null", '{"a": [1, {"b": null}]}', "hi", "𝄞", "\n", " ", "&amp;",
    'think x="1"', 'message role="assistant" role="user"', 'message role="a&b"', "message role=", "=",
]


@pytest.fixture(scope="module")
def x(xtml_tokenizer: PreTrainedTokenizerFast) -> XTML:
    return XTML(xtml_tokenizer)


def _vocab(x: XTML) -> int:
    return len(x.tokenizer)


@st.composite
def token_ids(draw: Any, x: XTML, max_items: int = 40) -> list[int]:
    """A sequence of ids: single ids (specials weighted up), encoded fragments and encoded arbitrary text."""
    specials = [x.open_id, x.close_id, x.sep_id, x.eom_id, x.pad_id] + ([x.image_id] if x.image_id is not None else [])
    item = st.one_of(
        st.sampled_from(specials).map(lambda t: [t]),
        st.integers(0, _vocab(x) - 1).map(lambda t: [t]),
        st.sampled_from(FRAGMENTS).map(lambda f: encode_text(x.tokenizer, f)),
        st.text(max_size=6).map(lambda s: encode_text(x.tokenizer, s)),
    )
    return [t for part in draw(st.lists(item, max_size=max_items)) for t in part]


def outcome(fn: Any, *args: Any, **kw: Any) -> tuple[str, Any, Any]:
    """("ok", result, None) or ("err", position, message); anything but XTMLParseError propagates."""
    try:
        return ("ok", fn(*args, **kw), None)
    except XTMLParseError as e:
        return ("err", e.position, e.message)


def stream_outcome(x: XTML, ids: list[int], mode: str, partial: bool) -> tuple[tuple[str, Any, Any], list[Any]]:
    """Feed ids one at a time into a stream parser: its outcome (as `outcome`) and the events."""
    sp = x.stream(mode)
    events: list[Any] = []
    for k, t in enumerate(ids):
        try:
            events.extend(sp.feed(t))
        except XTMLParseError as e:
            with pytest.raises(XTMLParseError):  # a failed parser stays failed
                sp.feed(t)
            assert e.position <= k, (e.position, k)  # an error never points past the token that showed it
            return ("err", e.position, e.message), events
    return outcome(sp.finish, partial), events


def check_all(x: XTML, ids: list[int]) -> None:
    """Every property of the module docstring for one id sequence."""
    n = len(ids)
    for mode in ("think", "instruct"):
        for partial in (False, True):
            for after_prefix in (False, True):
                got = outcome(x.parse, ids, mode=mode, partial=partial, after_prefix=after_prefix)
                if got[0] == "err":
                    assert 0 <= got[1] <= n and isinstance(got[2], str) and got[2], got
                else:
                    assert set(got[1]) == {"role", "reasoning_content", "content", "tool_calls"}
                if after_prefix:
                    streamed, events = stream_outcome(x, ids, mode, partial)
                    assert streamed == got, (streamed, got)
                    if got[0] == "ok":
                        check_events(events, got[1])
            v = x.validate(ids, mode=mode)
            vp = x.validate(ids, mode=mode, partial=True)
            for res in (v, vp):
                assert res.ok == (res.position is None)
                if not res.ok:
                    assert 0 <= res.position <= n and res.message
            if vp.ok:
                assert v.ok or v.position == n  # partial differs only at the end
            else:
                assert (v.position, v.message) == (vp.position, vp.message)
                assert x.validate(ids[: vp.position], mode=mode, partial=True).ok  # later tokens cannot matter
            if v.ok and mode == "think":  # a valid context or completion annotates, one label per token
                try:
                    a = x.annotate(ids)
                except ValueError:  # a completion without its message header is no context
                    assert not (ids and ids[0] == x.open_id and _is_context(x, ids))
                else:
                    assert len(a.message_index) == len(a.loss_mask) == n
            if not (ids and ids[0] == x.open_id and _is_context(x, ids)):
                plain = outcome(x.parse, ids, mode=mode)
                assert v.ok == (plain[0] == "ok")
                if not v.ok:
                    assert (v.position, v.message) == plain[1:]


def _is_context(x: XTML, ids: list[int]) -> bool:
    j = 1
    while j < len(ids) and ids[j] not in x._kind and 0 <= ids[j] < _vocab(x):
        j += 1
    text = x.tokenizer.backend_tokenizer.decode(ids[1:j], skip_special_tokens=False)
    return text == "message" or text.startswith(("message ", "message\t", "message\n", "message\r"))


def check_events(events: list[Any], msg: dict[str, Any]) -> None:
    """Deltas add up to each closed channel's text; a MessageEnd carries the parsed message."""
    for close in (e for e in events if isinstance(e, ChannelClose) and e.channel != "tools"):
        deltas = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel == close.channel)
        assert deltas == close.text, (deltas, close.text)
        assert close.text == (msg["reasoning_content"] if close.channel == "think" else msg["content"])
    ends = [e for e in events if isinstance(e, MessageEnd)]
    assert len(ends) <= 1 and all(e.message == msg for e in ends)


# --------------------------------------------------------------------------- arbitrary ids


@FAST
@given(st.data())
def test_fuzz_token_ids(x: XTML, data: Any) -> None:
    check_all(x, data.draw(token_ids(x)))


@pytest.mark.slow
@SLOW
@given(st.data())
def test_fuzz_token_ids_large(x: XTML, data: Any) -> None:
    check_all(x, data.draw(token_ids(x, max_items=120)))


@FAST
@given(st.data(), st.integers(0, 3))
def test_fuzz_ids_outside_the_vocabulary(x: XTML, data: Any, where: int) -> None:
    """An id that is no token of the tokenizer (negative, or >= its size) is malformed input: parse,
    stream and validate name its position (instead of an OverflowError, or decoding it to nothing)."""
    outside = st.integers(-(2**40), -1) | st.integers(_vocab(x), 2**40)
    bad = data.draw(st.lists(outside | st.sampled_from([x.open_id, x.sep_id, 7]), min_size=1, max_size=6))
    good = encode_text(x.tokenizer, "hi there")
    ids = good[:where] + bad + good[where:]
    check_all(x, ids)
    out = [k for k, t in enumerate(ids) if not 0 <= t < _vocab(x)]
    v = x.validate(ids)
    if out:
        assert not v.ok and v.position <= out[0], v
        if v.position == out[0]:
            assert "not a token" in v.message, v
        with pytest.raises(ValueError, match=f"token {out[0]}: id -?[0-9]+ is not a token"):
            x.annotate(ids)


# --------------------------------------------------------------------------- arbitrary text


@FAST
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from([O, C, S, E, "<|pad|>", *FRAGMENTS])), max_size=30))
def test_fuzz_text_with_special_tokens(x: XTML, parts: list[str]) -> None:
    """Arbitrary text, tokenized as a model's output would be: every special token spelled in it is its id."""
    ids = x.tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
    check_all(x, ids)


# --------------------------------------------------------------------------- every special token in every position


def _mutants(x: XTML, ids: list[int]) -> list[list[int]]:
    specials = [x.open_id, x.close_id, x.sep_id, x.eom_id, x.pad_id]
    out = []
    for k in range(len(ids) + 1):
        for s in specials:
            out.append(ids[:k] + [s] + ids[k:])  # inserted
            if k < len(ids):
                out.append(ids[:k] + [s] + ids[k + 1 :])  # swapped in
        if k < len(ids):
            out.append(ids[:k] + ids[k + 1 :])  # dropped
    return out


def test_every_special_token_in_every_position(x: XTML) -> None:
    """A tool-calling completion with every special token inserted at and swapped into every position,
    and every token dropped: each mutant parses, streams and validates by the properties."""
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "r 𝄞", "content": "a",
         "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1, "b": "s"}}},
                        {"function": {"name": "g", "arguments": "[1]"}}]},
    ]  # fmt: skip
    r = x.render(conv)
    span = [t for t, m in zip(r.ids, r.message_index) if m == 1]
    comp = span[len(x.generation_prefix()) :]
    for ids in (comp, span):
        muts = _mutants(x, ids)
        assert len(muts) > 500
        for m in muts:
            check_all(x, m)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.sampled_from(["think", "instruct"]))
def test_every_special_token_in_every_position_of_generated_contexts(x: XTML, conv: list[dict[str, Any]], mode: str) -> None:
    """The same over whole rendered contexts of generated conversations (slow: thousands of mutants)."""
    r = x.render(conv, mode=mode, add_generation_prompt=True)
    for m in _mutants(x, r.ids[-120:]):
        check_all(x, m)


# --------------------------------------------------------------------------- round trips and time


@FAST
@given(conversations(), st.sampled_from(["think", "instruct"]), st.data())
def test_fuzz_rendered_conversations(x: XTML, conv: list[dict[str, Any]], mode: str, data: Any) -> None:
    """A rendered context validates; each assistant completion satisfies every property and round-trips;
    so does the context and each completion after a few random edits (a special token or a fragment
    inserted, a token dropped or replaced)."""
    r = x.render(conv, mode=mode, add_generation_prompt=True)
    assert x.validate(r.ids, mode=mode).ok
    edit = st.tuples(st.integers(0, 10**6), st.sampled_from(["insert", "drop", "replace"]), token_ids(x, max_items=1))
    edits = data.draw(st.lists(edit, min_size=1, max_size=4))
    for i, m in enumerate(conv):
        if m["role"] == "assistant":
            span = [t for t, k in zip(r.ids, r.message_index) if k == i]
            comp = span[len(x.generation_prefix(mode)) :]
            check_all(x, comp)
            assert x.parse(comp, mode=mode, after_prefix=True)["content"] == m["content"]
            check_all(x, _edited(comp, edits))
    check_all(x, _edited(r.ids, edits))


def _edited(ids: list[int], edits: list[tuple[int, str, list[int]]]) -> list[int]:
    out = list(ids)
    for where, op, new in edits:
        k = where % (len(out) + 1)
        if op == "insert":
            out[k:k] = new
        elif k < len(out):
            out[k : k + 1] = new if op == "replace" else []
    return out


@pytest.mark.parametrize("junk", ["\x80", "𝄞"])
def test_degenerate_stream_is_linear(x: XTML, junk: str) -> None:
    """A stream of tokens that never complete a character (stray continuation bytes, or lone halves of
    4-byte characters) must not make each token cost the whole run so far: 4x the tokens, < ~8x the time."""
    one = encode_text(x.tokenizer, junk)
    piece = one[:1] if len(one) > 1 else one  # the first byte of a split character: never complete

    def run(n: int) -> float:
        sp = x.stream()
        t0 = time.perf_counter()
        for _ in range(n):
            sp.feed(piece[0])
        sp.finish(partial=True)
        return time.perf_counter() - t0

    run(200)
    small, big = min(run(1000) for _ in range(2)), min(run(4000) for _ in range(2))
    assert big < 8 * small + 0.05, (small, big)  # was quadratic: 0.06 s -> 0.91 s (15x)


def test_long_bad_header_is_not_quadratic(x: XTML) -> None:
    """An error inside a header of thousands of tokens is located by bisection, not one decode per token."""
    ids = [x.open_id] + encode_text(x.tokenizer, "ab") * 4000 + encode_text(x.tokenizer, "!") + [x.sep_id]
    t0 = time.perf_counter()
    res = x.validate(ids)
    assert (res.ok, res.position) == (False, len(ids) - 2) and "expected a space" in res.message, res
    assert time.perf_counter() - t0 < 1.0  # was 4000 decodes of up to 4000 tokens
    assert len(res.message) < 200  # the header is shortened in the message, not quoted whole


@pytest.mark.parametrize(
    "body, fragment",
    [("[" * 50_000, "nested too deeply"), ("NaN", "NaN is not valid JSON"), ("1e999", "out of range"),
     ("-Infinity", "not valid JSON"), ("1" * 5000, "4300 digits")],
    ids=["deep", "nan", "1e999", "-inf", "long-int"],
)  # fmt: skip
def test_model_written_argument_bodies_fail_as_parse_errors(x: XTML, body: str, fragment: str) -> None:
    """An argument body nested deeper than the JSON parser recurses raised RecursionError out of parse /
    stream / validate; NaN / Infinity were accepted and written back as invalid JSON arguments. Both are
    an XTMLParseError at the body's first token now."""
    head = encode_text(x.tokenizer, "r")
    call = ids_of_parts(x, [C, "think", S, O, "tools", S, O, 'call tool="f" index="1"', S,
                            O, 'argument key="a" type="number"', S])  # fmt: skip
    ids = head + call + encode_text(x.tokenizer, body) + ids_of_parts(x, [C, "argument", S])
    check_all(x, ids)
    with pytest.raises(XTMLParseError, match=fragment) as e:
        x.parse(ids, after_prefix=True)
    assert e.value.position == len(head) + len(call)
    # as a JSON-fallback argument string handed to the renderer: kept verbatim, not a crash
    calls = [{"function": {"name": "f", "arguments": body}}]
    r = x.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}])
    assert x.validate(r.ids).ok


def ids_of_parts(x: XTML, parts: list[str]) -> list[int]:
    """A special token string is its id, anything else encoded text."""
    return [t for p in parts for t in ([x._ids[p]] if p in x._ids else encode_text(x.tokenizer, p))]
