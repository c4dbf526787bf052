"""Fuzzing the parsers of engine-server answers (`k3post.rollout.server_dialects`, issue 20): whatever an
SGLang or vLLM server sends back (any JSON, or a recorded answer with one value replaced), parsing it
gives a result or a `DialectError` naming the server, never a TypeError / ValueError / KeyError /
AttributeError from inside the parser.

Shape legend: none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3post.rollout.server_dialects import Call, DialectError, K3postDialect, SGLangDialect, VLLMDialect

FIX = Path(__file__).resolve().parent / "fixtures" / "engine_api"
URL = "http://server"
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


def _answers(dialect: str) -> list[Any]:
    """Every recorded answer body of a dialect's fixtures (any nesting of "response" / "answer" keys)."""
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("response", "answer", "body") and isinstance(v, (dict, list)):
                    out.append(v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for f in sorted((FIX / dialect).glob("*.json")):
        walk(json.loads(f.read_text()))
    return out


@st.composite
def mutated(draw: Any, seeds: list[Any]) -> Any:
    """A recorded answer with one value somewhere replaced by an arbitrary JSON value."""
    value = json.loads(json.dumps(draw(st.sampled_from(seeds)))) if seeds else {}
    paths: list[list[Any]] = []

    def walk(x: Any, path: list[Any]) -> None:
        paths.append(path)
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            walk(v, path + [k])

    walk(value, [])
    path = draw(st.sampled_from(paths))
    new = draw(json_values)
    if not path:
        return new
    cur = value
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = new
    return value


def only_dialect_errors(fn: Any, *args: Any, **kw: Any) -> None:
    try:
        fn(*args, **kw)
    except DialectError as e:
        assert str(e).startswith(URL), str(e)


SGLANG = _answers("sglang")
VLLM = _answers("vllm")


def test_fixtures_seed_the_fuzzer() -> None:
    assert SGLANG and VLLM


@FAST
@given(st.one_of(json_values, mutated(SGLANG)))
def test_sglang_generate_answers(d: Any) -> None:
    only_dialect_errors(SGLangDialect().parse_generate, URL, "r1", d, 3)


@FAST
@given(st.one_of(json_values, mutated(SGLANG)), st.one_of(json_values, mutated(SGLANG)), st.none() | st.integers(1, 8))
def test_sglang_info_answers(model: Any, server: Any, slots: int | None) -> None:
    answers = {"/get_model_info": model, "/get_server_info": server}
    only_dialect_errors(SGLangDialect().parse_info, URL, answers, server_slots=slots)
    only_dialect_errors(K3postDialect().parse_info, URL, answers, server_slots=slots)


@FAST
@given(st.one_of(json_values, mutated(VLLM)), st.none() | st.integers(1, 8))
def test_vllm_info_answers(models: Any, slots: int | None) -> None:
    only_dialect_errors(VLLMDialect().parse_info, URL, {"/v1/models": models}, server_slots=slots)


@FAST
@given(st.one_of(json_values, mutated(VLLM)), st.sampled_from(["data: ", "data:", "", "event: x\ndata: "]))
def test_vllm_stream_lines(event: Any, prefix: str) -> None:
    line = prefix + (json.dumps(event) if not isinstance(event, str) else event)
    only_dialect_errors(VLLMDialect().parse_stream_line, URL, "r1", line, 3)


@FAST
@given(json_values, st.integers(100, 599))
def test_update_failures(d: Any, status: int) -> None:
    for dialect in (SGLangDialect(), VLLMDialect()):
        got = dialect.update_failure(URL, Call("POST", "/x", {}), status, d)
        assert got is None or got.startswith(URL)


@pytest.mark.parametrize(
    "d",
    [
        {"meta_info": {"output_token_logprobs": [["x", 5, "a"]], "finish_reason": {"type": "stop"}}},
        {"meta_info": {"output_token_logprobs": [[-0.1, None, "a"]], "finish_reason": {"type": "stop"}}},
        {"meta_info": {"output_token_logprobs": [[-0.1, 5, "a"]], "finish_reason": {"type": "stop"}}, "output_ids": 5},
        {"meta_info": {"output_token_logprobs": [[-0.1, 5, "a"]], "finish_reason": {"type": "stop"},
                       "weight_versions": [5]}},
    ],
    ids=["logprob-str", "id-none", "output_ids-int", "span-int"],
)  # fmt: skip
def test_sglang_generate_regressions(d: Any) -> None:
    """Answers the fuzzer found raising ValueError / TypeError from inside parse_generate (the last one
    was already a DialectError)."""
    with pytest.raises(DialectError, match=r"^http://server[:/]"):
        SGLangDialect().parse_generate(URL, "r1", d, 3)


@FAST
@given(json_values, st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=4), min_size=1, max_size=3))
def test_scoring_answers(d: Any, ids: list[list[int]]) -> None:
    """Whatever a server answers to a scoring call, each dialect's `parse_score` gives rows that fit ``ids`` or a
    `DialectError` naming the server."""
    for dialect in (K3postDialect(), SGLangDialect(), VLLMDialect()):
        try:
            rows = dialect.parse_score(URL, d, ids)
        except DialectError as e:
            assert str(e).startswith(URL), str(e)
            continue
        assert [len(r) for r in rows] == [len(s) - 1 for s in ids] and all(isinstance(x, float) for r in rows for x in r)
