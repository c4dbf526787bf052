"""Reading an OpenAI request body (`k3post.serve.app`): every field checked, a bad one a 400 (`APIError`) that names
it; sampling fields, effort, messages, tools, prompts, and the characters a request has the server tokenise."""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k3post.rollout.engine import SamplingParams, request_seed
from k3post.serve.server import EFFORT_CHOICES, INSTRUCT_EFFORT, APIError, ServeLimits, ServerState


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def number(body: Mapping[str, Any], key: str, default: float, *, lo: float, hi: float | None = None,
            lo_open: bool = False) -> float:
    """``body[key]`` as a float in [lo, hi] ((lo, hi] when lo_open); ``default`` if absent/null."""
    v = body.get(key)
    if v is None:
        return default
    ok = is_num(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise APIError(f"'{key}' must be a number in {rng}, got {v!r}", param=key)
    return float(v)


def integer(body: Mapping[str, Any], key: str, *, lo: int, hi: int | None = None) -> int | None:
    """``body[key]`` as an int in [lo, hi]; None if absent/null."""
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError(f"'{key}' must be an integer {rng}, got {v!r}", param=key)
    return int(v)


def boolean(body: Mapping[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def authorized(header: str, key: str) -> bool:
    """``Authorization: Bearer <key>``, the scheme matched case-insensitively (RFC 7235 §2.1, as the OpenAI API
    and vLLM accept ``bearer``), the key in constant time."""
    scheme, _, token = header.partition(" ")
    same = hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))
    return scheme.lower() == "bearer" and same


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A function name the OpenAI API accepts (``^[a-zA-Z0-9_-]{1,64}$``): no spaces, no markup, so no XTML token."""


def reject_unsupported(body: Mapping[str, Any]) -> None:
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = body.get(key)
        if v is not None and v != 0 and not (key == "repetition_penalty" and v == 1):
            raise APIError(f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
    min_tokens = body.get("min_tokens")  # vLLM's: the engine cannot hold the stop token back, so never ignored
    if min_tokens is not None and min_tokens != 0:
        raise APIError("'min_tokens' is not supported by this server (its engine cannot hold back the stop token); "
                       "omit it or send 0", param="min_tokens", code="unsupported_parameter")
    if body.get("logit_bias"):
        raise APIError("'logit_bias' is not supported by this server", param="logit_bias", code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, body.get("n") or 1):
        raise APIError("'best_of' is not supported by this server", param="best_of", code="unsupported_parameter")


def choice_seed(seed: int | None, i: int) -> int | None:
    """Seed of choice ``i`` of a request seeded ``seed`` (see the module docstring)."""
    if seed is None:
        return None
    return seed if i == 0 else request_seed(seed, f"choice-{i}")


@dataclass(frozen=True)
class Sampling:
    """Validated sampling fields of one request."""

    n: int
    params: list[SamplingParams]  # one per choice
    stop_ids: frozenset[int]


def limited(body: Mapping[str, Any], key: str, limit: int, setting: str) -> int | None:
    """``body[key]`` as an int >= 1; above ``limit`` a 400 naming the key and the server setting."""
    v = integer(body, key, lo=1)
    if v is not None and v > limit:
        raise APIError(f"'{key}'={v} exceeds this server's limit of {limit} (ServeLimits.{setting})", param=key,
                       code="limit_exceeded")
    return v


def sampling(body: Mapping[str, Any], *, prompt_len: int, max_model_len: int, vocab: int,
              default_stop_ids: frozenset[int], default_max_tokens: int | None, prompt_param: str,
              limits: ServeLimits) -> Sampling:
    """The SamplingParams of each choice; 400s name the offending field."""
    reject_unsupported(body)
    temperature = number(body, "temperature", 1.0, lo=0.0)
    top_p = number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = integer(body, "top_k", lo=-1) or 0
    n = limited(body, "n", limits.max_n, "max_n") or 1
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise APIError(f"'seed' must be an integer, got {seed!r}", param="seed")
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            f"the prompt is {prompt_len} tokens, which leaves no room under this model's maximum context length "
            f"of {max_model_len} tokens",
            param=prompt_param, code="context_length_exceeded",
        )
    max_tokens = limited(body, "max_completion_tokens", limits.max_tokens, "max_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = limited(body, "max_tokens", limits.max_tokens, "max_tokens"), "max_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
    elif max_tokens > room:
        raise APIError(
            f"'{key}'={max_tokens} plus the {prompt_len}-token prompt exceeds this model's maximum context length "
            f"of {max_model_len} tokens (at most {room} new tokens fit)",
            param=key, code="context_length_exceeded",
        )
    extra = body.get("stop_token_ids")
    stop_ids = set(default_stop_ids)
    if extra is not None:
        if not isinstance(extra, list) or not all(is_int(t) and 0 <= t < vocab for t in extra):
            raise APIError(f"'stop_token_ids' must be a list of token ids in [0, {vocab}), got {extra!r}",
                           param="stop_token_ids")
        stop_ids |= set(extra)
    ignore_eos = boolean(body, "ignore_eos")
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                       stop_ids=tuple(sorted(stop_ids)), seed=choice_seed(seed, i), ignore_eos=ignore_eos)
        for i in range(n)
    ]
    return Sampling(n, params, frozenset(stop_ids))


def parse_effort(body: Mapping[str, Any], default: str) -> tuple[str, str | None]:
    """(XTML mode, effort) from ``thinking_effort`` / ``reasoning_effort``."""
    te, re_ = body.get("thinking_effort"), body.get("reasoning_effort")
    if te is not None and re_ is not None and te != re_:
        raise APIError(f"'thinking_effort'={te!r} and its alias 'reasoning_effort'={re_!r} disagree",
                       param="thinking_effort")
    value, param = (te, "thinking_effort") if te is not None else (re_, "reasoning_effort")
    if value is None:
        value = default
    if value not in EFFORT_CHOICES:
        raise APIError(f"'{param}' must be one of {list(EFFORT_CHOICES)} ('none' = instruct mode, no thinking), "
                       f"got {value!r}", param=param)
    if value == INSTRUCT_EFFORT:
        return "instruct", None
    return "think", value


def parse_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's messages, checked for shape; ``developer`` becomes ``system``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list of chat messages", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            m = {**m, "role": "system"}
        elif role not in ("system", "user", "assistant", "tool"):
            raise APIError(f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {role!r}",
                           param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}",
                                   param=f"messages[{i}].content")
        if m.get("function_call") is not None:
            raise APIError(f"messages[{i}].function_call (legacy) is not supported; use tool_calls",
                           param=f"messages[{i}].function_call")
        out.append(m)
    return out


def parse_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    if body.get("functions") is not None:
        raise APIError("'functions' (legacy) is not supported; use 'tools'", param="functions")
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):  # a named function: the model is only prompted, never made to call it
        raise APIError("'tool_choice' naming a function is not supported by this server: it cannot force the model "
                       "to call that function; use 'auto', 'required' or 'none'", param="tool_choice",
                       code="unsupported_parameter")
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list of {'type': 'function', 'function': {...}}", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}, got {t!r}",
                           param=f"tools[{i}]")
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise APIError(f"tools[{i}].function.name {fn['name']!r} must match ^[a-zA-Z0-9_-]{{1,64}}$ (letters, "
                           "digits, '_' and '-', at most 64)", param=f"tools[{i}].function.name")
    return tools or None


def wants_usage(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage``; ``stream_options`` must be an object (or null) and ``include_usage`` a
    boolean, else a 400 naming the field."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, Mapping):
        raise APIError(f"'stream_options' must be an object, got {type(opts).__name__}", param="stream_options")
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise APIError(f"'stream_options.include_usage' must be a boolean, got {v!r}", param="stream_options.include_usage")
    return bool(v)


def render_param(message: str) -> str:
    """The request field an XTML render error is about."""
    for key in ("tool_choice", "response_format", "tools"):
        if message.startswith(key):
            return key
    return "messages"




def text_chars(*objs: Any) -> int:
    """Characters in every string (keys included) of ``objs``: the text a request has the server tokenise."""
    total, stack = 0, list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            total += len(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return total


def check_prompt_chars(limits: ServeLimits, chars: int, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise APIError(f"the request holds {chars} characters of text to tokenise; this server's limit is "
                       f"{limits.max_prompt_chars} (ServeLimits.max_prompt_chars)", param=param, code="limit_exceeded")




def parse_prompts(body: Mapping[str, Any], srv: ServerState) -> list[list[int]]:
    """``prompt`` as token-id lists: a string, a list of ids, or a batch of either."""
    p = body.get("prompt")

    def encode(s: str) -> list[int]:
        ids = list(srv.tokenizer.encode(s, add_special_tokens=False))
        if not ids:
            raise APIError("'prompt' encodes to no tokens", param="prompt")
        return ids

    def check(ids: list[Any]) -> list[int]:
        if not ids or not all(is_int(t) and 0 <= t < srv.vocab for t in ids):
            raise APIError(f"'prompt' token ids must be a non-empty list of ints in [0, {srv.vocab})", param="prompt")
        return [int(t) for t in ids]

    if isinstance(p, str):
        return [encode(p)]
    if isinstance(p, list) and p:
        if all(is_int(t) for t in p):
            return [check(p)]
        if all(isinstance(s, str) for s in p):
            return [encode(s) for s in p]
        if all(isinstance(x, list) for x in p):
            return [check(x) for x in p]
    raise APIError("'prompt' must be a string, a list of token ids, or a non-empty list of either", param="prompt")
