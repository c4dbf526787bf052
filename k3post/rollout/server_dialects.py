"""Server dialects of `HTTPEngine`: the wire format of a k3post, an SGLang or a vLLM engine server.

`HTTPEngine` drives every server through the same steps (read model info, generate, abort,
load weights); a dialect turns each step into that server's HTTP calls and parses its answers.
Everything here is pure: request bodies in, parsed tokens / info out, no I/O, so each dialect is
unit-tested against recorded request and response shapes (``tests/fixtures/engine_api``).

k3post (``k3post serve``, `k3post.serve.engine_api`)
    SGLang's endpoint names plus a ``continuation`` field (tokens already sampled, with their
    log-probs and versions) and per-token ``meta_info.versions``; counter-based sampling makes a
    continuation draw exactly the tokens the uninterrupted request would have. `HTTPEngine` keeps
    its own code path for it (this module only reads its model info).

sglang (``python -m sglang.launch_server``; the native API of ``sglang/srt/entrypoints/http_server.py``)
    * ``POST /generate`` ``{"rid", "input_ids", "sampling_params", "return_logprob": true}``:
      a continuation is a re-prefill, ``input_ids`` = prompt + tokens so far and
      ``max_new_tokens`` = what is left of the budget. The answer's
      ``meta_info.output_token_logprobs`` ([logprob, token id, text], one per new token) gives
      the tokens and their log-probs, ``meta_info.finish_reason.type`` the finish ("stop" |
      "length" | "abort").
    * Versions: SGLang's weight version is a string; k3post sends ``str(version)`` and reads
      it back with `parse_version` (the launch default ``"default"`` is version 0). New tokens
      get ``meta_info.weight_versions`` spans when the server returns them (SGLang with
      per-request version spans: ``[{"version", "start", "end"}]`` over this call's output
      tokens), else ``meta_info.weight_version`` for every new token: the server's version when
      it answered, so tokens that straddle an in-place update are attributed to the new
      version. That is why `HTTPEngine` refuses ``update_weights`` while a request runs on an
      SGLang / vLLM server: pause first (the partial-rollout scheduler does).
    * ``POST /abort_request`` ``{"rid"}``: the aborted ``/generate`` answers 200 with its partial
      output, finish "abort". SGLang aborts every request whose rid *starts with* the given
      one, so wire rids here are fixed-width (32 hex digits) and never prefixes of each other.
    * Model info: ``GET /get_model_info`` (``weight_version``, ``is_generation``) and
      ``GET /get_server_info`` (the server args: ``context_length``, ``max_running_requests``;
      the scheduler's ``max_req_input_len``, ``max_total_num_tokens``).
    * Weights: ``POST /update_weights_from_disk`` ``{"model_path", "weight_version",
      "flush_cache": true}`` over a folder of ``*.safetensors`` (a `DiskSync` version folder
      without QAT is one: plain HF-named tensors; its ``manifest.json`` is ignored by SGLang).
      ``/init_weights_update_group`` and ``/update_weights_from_distributed`` bodies are built
      by `sglang_init_group_body` / `sglang_update_distributed_body`, but SGLang receives one
      ``torch.distributed.broadcast`` per tensor (NCCL), not k3post's ``DistributedSync``
      buckets, so `HTTPEngine` refuses ``weight_sync="distributed"`` for this dialect.

vllm (``vllm serve ... --weight-transfer-config '{"backend": "disk"}'`` with ``VLLM_SERVER_DEV_MODE=1``)
    * ``POST /v1/completions`` with ``prompt`` = token ids (prompt + tokens so far), ``stream:
      true``, ``logprobs: 0`` (the sampled token's log-prob), ``return_tokens_as_token_ids``
      (tokens come back as ``"token_id:<id>"``), ``stop_token_ids``, ``seed``,
      ``skip_special_tokens: false``, ``include_stop_str_in_output: true``, ``request_id`` (also
      as the ``X-Request-Id`` header). Each server-sent event is a delta: its tokens and
      log-probs are kept as they arrive.
    * Pause / abort of one request: the client closes the stream; vLLM aborts a request whose
      client disconnected. The tokens received before the close are the partial output (those
      sampled but not yet sent are dropped and resampled by the continuation). vLLM's
      ``/pause`` (whole engine) is not used: k3post pauses single requests.
    * Versions: vLLM's completion answers carry no weight version; new tokens get the version
      `HTTPEngine` last loaded (exact, since weights only change through it and never while a
      request runs). The server's own version: ``GET /weight_info`` (dev mode).
    * Model info: ``GET /v1/models`` (``data[0].id``, ``data[0].max_model_len``); vLLM reports
      no batch size over HTTP, so `HTTPEngine` takes ``server_slots``.
    * Weights (dev mode, disk backend): ``POST /init_weight_transfer_engine`` ``{"init_info":
      {}}`` once per server, then per update ``POST /start_weight_update``, ``POST
      /update_weights`` ``{"update_info": {"path"}}`` (an absolute folder of ``*.safetensors``;
      vLLM reloads layer-wise, so push every weight), ``POST /finish_weight_update``
      ``{"weight_version"}``. The NCCL backend's bodies are built by `vllm_nccl_init_body` /
      `vllm_nccl_update_body`; its trainer side is vLLM's own ``PyNcclCommunicator``, so
      `HTTPEngine` refuses ``weight_sync="distributed"`` for this dialect too.

What no dialect but k3post gives: exact resampling of a continuation (SGLang's and vLLM's
samplers draw from their own generators: a paused and resumed request draws different tokens
than an uninterrupted one; each token's log-prob is still the one it was sampled with) and
per-token versions from the server (SGLang without spans, vLLM: per response).

Shape legend: none (token lists and JSON bodies).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3post.rollout.adapters import (check_score_rows, from_sglang_input_logprobs, normalize_finish_reason, to_sglang_sampling_params,
                                     to_vllm_sampling_kwargs)
from k3post.rollout.engine import GenerationRequest

__all__ = [
    "DIALECTS",
    "Call",
    "DialectError",
    "Piece",
    "K3postDialect",
    "SGLangDialect",
    "VLLMDialect",
    "make_dialect",
    "parse_version",
    "sglang_init_group_body",
    "sglang_update_distributed_body",
    "vllm_nccl_init_body",
    "vllm_nccl_update_body",
]

DIALECTS = ("k3post", "sglang", "vllm")


class DialectError(RuntimeError):
    """A server's answer does not have the shape its dialect promises; the message names the
    server URL, the endpoint, the request and the field."""


def _parses_answers(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A parser of server answers (``fn(self, url, ...)``) raises only `DialectError`: a TypeError /
    ValueError / KeyError / AttributeError / IndexError from a value of the wrong type anywhere in the
    answer (a null logprob, a string id, a list where a mapping belongs) becomes one naming the server
    and the parser (tests/test_fuzz_dialects.py, issue 20)."""

    @functools.wraps(fn)
    def parse(self: Any, url: str, *args: Any, **kw: Any) -> Any:
        try:
            return fn(self, url, *args, **kw)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise DialectError(f"{url}: malformed answer ({fn.__name__}: {type(e).__name__}: {e})") from e

    return parse


@dataclass(frozen=True)
class Call:
    """One HTTP call: ``method`` ("GET" | "POST"), ``path``, JSON ``body``, extra ``headers``."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Piece:
    """New tokens parsed from one answer (or one streamed delta): ids, their log-probs and
    versions, and the finish ("stop" | "length" | "abort"; None while a stream goes on)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


def parse_version(value: Any, where: str) -> int:
    """An SGLang / vLLM weight version (a string; k3post writes ``str(int)``) as an int; the
    launch default ``"default"`` (and None) is 0. Anything else is a DialectError naming ``where``."""
    if value is None or value == "default":
        return 0
    if isinstance(value, bool):
        raise DialectError(f"{where}: weight version {value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise DialectError(f"{where}: weight version {value!r} is not an integer (k3post sets str(int) versions; "
                       "start the server with --weight-version 0 or leave the default)")


def _field(d: Any, path: str, where: str) -> Any:
    """``d[a][b]...`` for ``path`` = "a.b...", else a DialectError naming ``where`` and the field."""
    cur = d
    for key in path.split("."):
        if isinstance(cur, list) and key.isdigit() and int(key) < len(cur):
            cur = cur[int(key)]
        elif isinstance(cur, Mapping) and key in cur:
            cur = cur[key]
        else:
            raise DialectError(f"{where}: the answer has no {path}")
    return cur


def _continuation(req: GenerationRequest, ids: Sequence[int]) -> GenerationRequest:
    """``req`` with ``ids`` as its given tokens (only prompt, sampling and the count matter)."""
    return GenerationRequest(req.request_id, list(req.prompt_ids), req.sampling, given_ids=list(ids),
                             given_logprobs=[0.0] * len(ids), given_versions=[0] * len(ids))


class K3postDialect:
    """``k3post serve``: HTTPEngine's own code path; model info from ``GET /get_model_info``."""

    name = "k3post"
    streams = False

    def info_calls(self) -> list[Call]:
        return [Call("GET", "/get_model_info")]

    @_parses_answers
    def parse_info(self, url: str, answers: Mapping[str, Any], *, server_slots: int | None = None) -> dict[str, Any]:
        """The k3post model info as it is (``weight_version``, ``max_batch_size``,
        ``max_model_len``, ``qat``)."""
        return dict(answers["/get_model_info"])

    def abort_call(self, wire_rid: str) -> Call | None:
        return Call("POST", "/abort_request", {"rid": wire_rid})

    def score_call(self, ids: Sequence[Sequence[int]]) -> Call:
        """``POST /score`` (`k3post.serve.engine_api`)."""
        return Call("POST", "/score", {"input_ids": [list(s) for s in ids]})

    @_parses_answers
    def parse_score(self, url: str, d: Any, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        return check_score_rows(ids, _field(d, "logprobs", f"{url}/score"))


class SGLangDialect:
    """SGLang's native HTTP API (module doc)."""

    name = "sglang"
    streams = False

    def info_calls(self) -> list[Call]:
        return [Call("GET", "/get_model_info"), Call("GET", "/get_server_info")]

    @_parses_answers
    def parse_info(self, url: str, answers: Mapping[str, Any], *, server_slots: int | None = None) -> dict[str, Any]:
        """k3post-shaped info from SGLang's ``/get_model_info`` and ``/get_server_info``:
        ``max_model_len`` = ``context_length`` (else ``max_req_input_len`` + 1), ``max_batch_size``
        = ``max_running_requests`` (else ``server_slots``), ``weight_version`` as an int."""
        model, server = answers["/get_model_info"], answers["/get_server_info"]
        if model.get("is_generation") is False:
            raise DialectError(f"{url}/get_model_info: is_generation is false (an embedding model, not a generator)")
        version = parse_version(_field(model, "weight_version", f"{url}/get_model_info"), f"{url}/get_model_info")
        ctx = server.get("context_length")
        if ctx is None:
            ctx = int(_field(server, "max_req_input_len", f"{url}/get_server_info")) + 1
        slots = server.get("max_running_requests") or server_slots
        if not slots:
            raise DialectError(f"{url}/get_server_info: max_running_requests is null (start SGLang with "
                               "--max-running-requests, or give HTTPEngine server_slots; from a config: "
                               "engine.max_concurrency)")
        return {"weight_version": version, "max_model_len": int(ctx), "max_batch_size": int(slots), "qat": None}

    def generate_call(self, wire_rid: str, req: GenerationRequest, ids: Sequence[int],
                      default_stop_ids: Sequence[int] | None) -> Call:
        """``POST /generate`` continuing ``req`` after its tokens ``ids`` (a re-prefill)."""
        params = to_sglang_sampling_params(_continuation(req, ids), default_stop_ids or ())
        if req.sampling.stop_ids is None and not default_stop_ids and not req.sampling.ignore_eos:
            del params["stop_token_ids"]  # the server's own EOS ids
        params["no_stop_trim"] = True
        body = {"rid": wire_rid, "input_ids": list(req.prompt_ids) + list(ids), "sampling_params": params,
                "return_logprob": True}
        return Call("POST", "/generate", body)

    @_parses_answers
    def parse_generate(self, url: str, rid: str, d: Any, version: int) -> Piece:
        """The new tokens of one ``/generate`` answer; ``version`` (the client's) is used only
        when the answer carries no weight version."""
        where = f"{url}/generate (request {rid!r})"
        meta = _field(d, "meta_info", where)
        pairs = _field(meta, "output_token_logprobs", where + " meta_info") if isinstance(meta, Mapping) else None
        if not isinstance(pairs, list):
            raise DialectError(f"{where}: meta_info.output_token_logprobs is not a list (send return_logprob: true)")
        ids, lps = [], []
        for p in pairs:
            if not isinstance(p, (list, tuple)) or len(p) < 2 or p[0] is None:
                raise DialectError(f"{where}: meta_info.output_token_logprobs entry {p!r} is not [logprob, token_id, text]")
            lps.append(float(p[0]))
            ids.append(int(p[1]))
        if "output_ids" in d and [int(t) for t in d["output_ids"]] != ids:
            raise DialectError(f"{where}: output_ids disagree with meta_info.output_token_logprobs")
        finish = normalize_finish_reason(_field(meta, "finish_reason", where + " meta_info"))
        return Piece(ids, lps, self._versions(meta, len(ids), version, where), finish)

    @staticmethod
    def _versions(meta: Mapping[str, Any], n: int, version: int, where: str) -> list[int]:
        spans = meta.get("weight_versions")
        if spans:
            out: list[int] = []
            for s in spans:
                v = parse_version(_field(s, "version", where + " meta_info.weight_versions"), where)
                start, end = int(s["start"]), min(int(s["end"]), n)
                if start != len(out) or end < start:
                    raise DialectError(f"{where}: meta_info.weight_versions spans {spans} do not tile the {n} tokens")
                out += [v] * (end - start)
            if len(out) != n:
                raise DialectError(f"{where}: meta_info.weight_versions spans {spans} cover {len(out)} of {n} tokens")
            return out
        if "weight_version" in meta:
            return [parse_version(meta["weight_version"], where)] * n
        return [version] * n

    def abort_call(self, wire_rid: str) -> Call | None:
        return Call("POST", "/abort_request", {"rid": wire_rid})

    def score_call(self, ids: Sequence[Sequence[int]]) -> Call:
        """A batched prefill-only ``POST /generate``: no new token, the input's log-probs from its first token."""
        return Call("POST", "/generate", {"input_ids": [list(s) for s in ids], "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0})

    @_parses_answers
    def parse_score(self, url: str, d: Any, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The answers' input-token log-probs (`k3post.rollout.adapters.from_sglang_input_logprobs`, shared with
        the offline SGLang engine)."""
        return from_sglang_input_logprobs(ids, d)

    def init_weight_calls(self) -> list[Call]:
        return []

    def version_calls(self, version: int) -> list[Call]:
        """Set the server's weight version without loading weights (``UpdateWeightVersionReqInput``;
        its ``abort_all_requests`` defaults to true, so it is sent false)."""
        return [Call("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})]

    def disk_update_calls(self, path: str, version: int) -> list[Call]:
        return [Call("POST", "/update_weights_from_disk",
                     {"model_path": path, "weight_version": str(version), "flush_cache": True})]

    @_parses_answers
    def update_failure(self, url: str, call: Call, status: int, d: Any) -> str | None:
        """None when a weight-update call succeeded, else the server's reason."""
        if status == 200 and (not isinstance(d, Mapping) or d.get("success", True)):
            return None
        msg = d.get("message", d) if isinstance(d, Mapping) else d
        return f"{url}{call.path}: HTTP {status}: {msg}"


class VLLMDialect:
    """vLLM's OpenAI-compatible server plus its dev-mode RL endpoints (module doc)."""

    name = "vllm"
    streams = True

    def __init__(self) -> None:
        self.model: str | None = None

    def info_calls(self) -> list[Call]:
        return [Call("GET", "/v1/models")]

    @_parses_answers
    def parse_info(self, url: str, answers: Mapping[str, Any], *, server_slots: int | None = None) -> dict[str, Any]:
        """k3post-shaped info from ``/v1/models`` (the first model); ``max_batch_size`` =
        ``server_slots`` (vLLM does not report it); version 0 until k3post loads weights."""
        where = f"{url}/v1/models"
        card = _field(answers["/v1/models"], "data.0", where)
        self.model = str(_field(card, "id", where + " data[0]"))
        if not server_slots:
            raise DialectError(f"{where}: vLLM reports no batch size over HTTP; give HTTPEngine server_slots "
                               "(its --max-num-seqs; from a config: engine.max_concurrency)")
        return {"weight_version": 0, "max_model_len": int(_field(card, "max_model_len", where + " data[0]")),
                "max_batch_size": int(server_slots), "qat": None}

    def generate_call(self, wire_rid: str, req: GenerationRequest, ids: Sequence[int],
                      default_stop_ids: Sequence[int] | None) -> Call:
        """Streaming ``POST /v1/completions`` continuing ``req`` after ``ids`` (a re-prefill)."""
        kw = to_vllm_sampling_kwargs(_continuation(req, ids), default_stop_ids or ())
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(req.prompt_ids) + list(ids), "max_tokens": kw["max_tokens"],
            "temperature": kw["temperature"], "top_p": kw["top_p"], "top_k": kw["top_k"], "seed": kw["seed"],
            "stop_token_ids": kw["stop_token_ids"], "ignore_eos": kw["ignore_eos"], "n": 1, "logprobs": 0,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": True,
            "stream": True, "request_id": wire_rid,
        }
        return Call("POST", "/v1/completions", body, {"X-Request-Id": wire_rid})

    @_parses_answers
    def parse_stream_line(self, url: str, rid: str, line: str, version: int) -> Piece | None:
        """One server-sent-event line of a streamed completion: its delta tokens (stamped
        ``version``), None for blank lines, comments and ``[DONE]``."""
        line = line.strip()
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        where = f"{url}/v1/completions (request {rid!r})"
        try:
            d = json.loads(data)
        except json.JSONDecodeError as e:
            raise DialectError(f"{where}: a stream event is not JSON ({e}): {data[:200]}") from e
        if "error" in d:
            raise DialectError(f"{where}: the server reported an error mid-stream: {d['error']}")
        choice = _field(d, "choices.0", where)
        lp = choice.get("logprobs")
        if lp is None:
            if choice.get("text") or choice.get("token_ids"):
                raise DialectError(f"{where}: choices[0].logprobs is missing (send logprobs: 0)")
            lp = {"tokens": [], "token_logprobs": []}
        tokens, lps = _field(lp, "tokens", where + " choices[0].logprobs"), lp.get("token_logprobs")
        if not isinstance(lps, list) or len(lps) != len(tokens) or any(x is None for x in lps):
            raise DialectError(f"{where}: choices[0].logprobs.token_logprobs {lps!r} does not give one log-prob "
                               f"per token of {tokens!r}")
        ids = []
        for t in tokens:
            if not (isinstance(t, str) and t.startswith("token_id:")):
                raise DialectError(f"{where}: choices[0].logprobs.tokens entry {t!r} is not 'token_id:<id>' "
                                   "(send return_tokens_as_token_ids: true)")
            ids.append(int(t.removeprefix("token_id:")))
        if choice.get("token_ids") is not None and [int(t) for t in choice["token_ids"]] != ids:
            raise DialectError(f"{where}: choices[0].token_ids disagree with choices[0].logprobs.tokens")
        reason = choice.get("finish_reason")
        finish = normalize_finish_reason(reason) if reason is not None else None
        return Piece(ids, [float(x) for x in lps], [version] * len(ids), finish)

    def abort_call(self, wire_rid: str) -> Call | None:
        """None: a request is aborted by closing its stream (module doc)."""
        return None

    def score_call(self, ids: Sequence[Sequence[int]]) -> Call:
        """``POST /v1/completions`` with ``echo``: the prompt's log-probs, then one greedy token that is ignored
        (``max_tokens`` 1: not every vLLM version accepts 0)."""
        return Call("POST", "/v1/completions", {
            "model": self.model, "prompt": [list(s) for s in ids], "echo": True, "logprobs": 0, "max_tokens": 1,
            "temperature": 0.0, "n": 1, "return_tokens_as_token_ids": True, "skip_special_tokens": False})

    @_parses_answers
    def parse_score(self, url: str, d: Any, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """``choices[b].logprobs.token_logprobs`` over the echoed prompt (None first), the sampled token's dropped;
        the echoed tokens must be the ones sent."""
        where = f"{url}/v1/completions (scoring)"
        choices = _field(d, "choices", where)
        if not isinstance(choices, list) or len(choices) != len(ids):
            raise DialectError(f"{where}: expected {len(ids)} choices, got {str(choices)[:200]}")
        rows = []
        for b, (seq, c) in enumerate(zip(ids, sorted(choices, key=lambda c: int(_field(c, "index", where))))):
            lp = _field(c, "logprobs", f"{where} choices[{b}]")
            tokens, lps = _field(lp, "tokens", f"{where} choices[{b}].logprobs"), lp.get("token_logprobs")
            echoed = [int(t.removeprefix("token_id:")) if isinstance(t, str) and t.startswith("token_id:") else None
                      for t in tokens[: len(seq)]]
            if echoed != list(seq) or not isinstance(lps, list) or len(lps) < len(seq):
                raise DialectError(f"{where}: choices[{b}] does not echo its {len(seq)} prompt tokens with their "
                                   f"log-probs (send echo: true, return_tokens_as_token_ids: true): {str(lp)[:200]}")
            rows.append(lps[1: len(seq)])
        return check_score_rows(ids, rows)

    def init_weight_calls(self) -> list[Call]:
        return [Call("POST", "/init_weight_transfer_engine", {"init_info": {}})]

    def version_calls(self, version: int) -> list[Call]:
        """Set the server's weight version without loading weights (dev ``/update_weight_version``)."""
        return [Call("POST", "/update_weight_version", {"new_version": str(version)})]

    def disk_update_calls(self, path: str, version: int) -> list[Call]:
        return [Call("POST", "/start_weight_update"),
                Call("POST", "/update_weights", {"update_info": {"path": path}}),
                Call("POST", "/finish_weight_update", {"weight_version": str(version)})]

    @_parses_answers
    def update_failure(self, url: str, call: Call, status: int, d: Any) -> str | None:
        if status == 200:
            return None
        msg = (d.get("detail") or d.get("error") or d.get("message") or d) if isinstance(d, Mapping) else d
        hint = " (start vLLM with VLLM_SERVER_DEV_MODE=1)" if status == 404 else ""
        return f"{url}{call.path}: HTTP {status}: {msg}{hint}"


def make_dialect(name: str) -> K3postDialect | SGLangDialect | VLLMDialect:
    """The dialect called ``name`` (one of `DIALECTS`)."""
    if name == "k3post":
        return K3postDialect()
    if name == "sglang":
        return SGLangDialect()
    if name == "vllm":
        return VLLMDialect()
    raise ValueError(f"dialect must be one of {DIALECTS}, got {name!r}")


def _metadata(items: Sequence[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    names = [n for n, _ in items]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in items]
    return names, dtypes, [list(t.shape) for _, t in items]


def sglang_init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl") -> dict[str, Any]:
    """SGLang's ``InitWeightsUpdateGroupReqInput``: join the trainer's group as rank ``rank_offset``."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def sglang_update_distributed_body(items: Sequence[tuple[str, Any]], group_name: str, version: int) -> dict[str, Any]:
    """SGLang's ``UpdateWeightsFromDistributedReqInput``: the tensors (name, dtype, shape) that rank 0
    then broadcasts one by one, in this order."""
    names, dtypes, shapes = _metadata(items)
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": True, "weight_version": str(version)}


def vllm_nccl_init_body(master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
    """vLLM's ``/init_weight_transfer_engine`` body for its NCCL backend (``NCCLWeightTransferInitInfo``)."""
    return {"init_info": {"master_address": master_address, "master_port": int(master_port),
                          "rank_offset": int(rank_offset), "world_size": int(world_size)}}


def vllm_nccl_update_body(items: Sequence[tuple[str, Any]], packed: bool = False) -> dict[str, Any]:
    """vLLM's ``/update_weights`` body for its NCCL backend (``NCCLWeightTransferUpdateInfo``)."""
    names, dtypes, shapes = _metadata(items)
    return {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": bool(packed)}}
