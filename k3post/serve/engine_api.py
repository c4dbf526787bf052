"""The engine-server API: the rollout-engine protocol over HTTP, with SGLang's endpoint names.

`k3post serve` exposes it next to the OpenAI API (``create_app`` includes `engine_router`), so
`k3post.rollout.http_engine.HTTPEngine` (and any client written for SGLang's native API) drives
a k3post server at the level of token ids, log-probs and policy versions:

* ``POST /generate``: one request on token ids::

      {"input_ids": [int, ...], "rid": str (optional),
       "sampling_params": {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids",
                           "ignore_eos", "seed" (k3post; SGLang's "sampling_seed" is accepted too),
                           "stop_ids" (k3post)},
       "return_logprob": bool,
       "continuation": {"output_ids": [...], "output_logprobs": [...], "output_versions": [...]}}

  ``continuation`` (k3post) resumes a partial trajectory on any server: the tokens already
  sampled for this request with their recorded log-probs and versions. The server
  re-prefills prompt + continuation and samples only the rest; counter-based sampling
  (``k3post.rollout.engine``) draws exactly the tokens the uninterrupted request would have.
  The response covers the whole output (continuation first), shaped like SGLang's::

      {"text": str, "output_ids": [...],
       "meta_info": {"id", "finish_reason": {"type": "stop" | "length" | "abort", ...},
                     "prompt_tokens", "completion_tokens", "given_tokens",
                     "output_token_logprobs": [[logprob, token_id, null], ...]   (return_logprob),
                     "versions": [int, ...], "kv_versions": [int, ...], "weight_version": int}}

  A server started with ``--record-routes`` adds ``"routes"``: the experts every context position the engine
  fed (prompt and output but the last token) was routed to per MoE layer, `k3post.routing_replay.encode_routes`
  text ("TxMxK:" + base64 int16).

  ``kv_versions[i]``: the oldest weight version among the KV entries output token i attended to (below
  ``versions[i]`` when the request ran across a weight update; -1 for continuation tokens, which the
  server did not sample).

  Sampling fields: ``top_k`` 0 or -1 disables it; ``max_new_tokens`` is the request's output
  budget, continuation tokens included (default: the room left under ``max_model_len``,
  capped by ``ServeConfig.default_max_tokens``; more than ``ServeLimits.max_tokens`` is a 400); ``stop_token_ids`` are added to the
  engine's default stop ids (``<|end_of_msg|>``), as in SGLang; ``stop_ids`` (k3post)
  replaces them (``[]``: never stop early). Log-probs are those of the raw model
  distribution (the engine convention). Unknown sampling keys are a 400 naming the key.
* ``POST /score`` ``{"input_ids": [[int, ...], ...]}`` (k3post): the served model's log-probs of each given
  sequence, prefill only: ``{"logprobs": [[log p(ids[t] | ids[:t]) for t >= 1], ...], "weight_version"}``
  (`k3post.rollout.engine.ScoringEngine`; `HTTPEngine.score` is its client). Batched between engine steps
  like the OpenAI ``echo`` (``ServeLimits.echo_batch_tokens``), counted in flight (429 when full).
* ``POST /abort_request`` ``{"rid"}`` (or ``{"abort_all": true}``): the pending ``/generate``
  of that request answers with its partial output, finish_reason ``abort``. Unknown ids
  are ignored (the request may have just finished).
* ``POST /pause_generation`` / ``POST /continue_generation``: stop / restart stepping the
  engine; queued and running requests keep their state (and their HTTP calls stay open).
* ``POST /flush_cache``: drop the KV states the engine keeps for finished requests.
* ``GET /get_model_info`` (the model folder's name, not its path; the QAT scheme the engine runs), ``GET /get_weight_version`` (also in ``/health`` under
  ``engine.weight_version``).
* ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"}``: load a weight
  version written by ``k3post.distributed.weight_sync.DiskSync`` (``manifest.json``: shard
  sizes and sha256, the version, the QAT scheme, which must be the one the server runs), or the
  ``*.safetensors`` files of a local folder, tensors named as the model's parameters or a
  whole Hugging Face checkpoint (`read_weights_folder`), and apply them between two engine
  steps, all or nothing: every file is read and every tensor checked before any is copied
  (`check_complete`: every parameter and persistent buffer of the served model is there;
  each tensor a known name with the model's shape and dtype, where a floating-point tensor
  of another floating-point dtype is cast to the model's, e.g. bf16 files into an fp32
  model; finite values), so on an error neither the weights nor the version change and the
  400 (``{"success": false, "message"}``) names the file and key. ``weight_version`` (int,
  default current + 1) must exceed the current version.
* ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend", "timeout_s" (k3post, default 300)}``: join the
  trainer's weight-sync group (``weight_sync.DistributedSync`` is rank 0 at
  ``tcp://master_address:master_port``) as rank ``rank_offset``. The rendezvous blocks until
  every rank joined, so it runs in a worker thread (generation goes on) and the trainer calls
  every server concurrently while it builds its ``DistributedSync``. ``backend`` ``gloo``
  stages the weights on the CPU, ``nccl`` on the engine's CUDA device.
* ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name",
  "weight_version", "flush_cache"}`` (SGLang's fields): take part in one broadcast sync of
  that group (``DistributedReceiver.receive``) on the engine thread, so generation is paused
  while the weights arrive. The manifest travels in the broadcast itself; the posted names /
  dtypes / shapes (when given) and ``weight_version`` must equal it, else this server votes
  against the manifest and no engine applies the sync; so does a manifest that does not carry
  every weight of the served model (`check_complete`). All or nothing: a rejected or
  interrupted sync answers 400 ``{"success": false, "message", "weight_version"}`` naming the
  reason and leaves the old weights and version (an interrupted group is dropped: init a new
  one). ``flush_cache`` (default true) drops the KV kept for finished requests.
* ``POST /destroy_weights_update_group`` ``{"group_name"}``: leave the group.
* ``POST /get_weights_by_name`` ``{"name", "truncate_size"}`` (SGLang's): the first
  ``truncate_size`` (default 100, at most ``ServeLimits.max_weight_values``) values of a
  parameter or buffer, flattened (float32 values survive JSON exactly), plus its shape and
  dtype: how a test checks the weights a sync left.

Shape legend: none (token lists; weights are checked by name and shape only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from k3post.rollout.engine import GenerationRequest, GenerationResult, SamplingParams, check_score_ids
from k3post.routing_replay import encode_routes
from k3post.serve.server import APIError, ServerState, json_body
from k3post.tokenizer import decode

__all__ = ["engine_router", "read_weights_folder", "apply_weights", "check_complete"]

_SAMPLING_KEYS = frozenset(
    ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop_ids", "ignore_eos", "seed", "sampling_seed")
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(v: Any, name: str, vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < vocab for t in v):
        raise APIError(f"'{name}' must be a list of token ids in [0, {vocab})", param=name)
    return list(v)


def _sampling(sp: Any, *, context_len: int, srv: ServerState) -> SamplingParams:
    """SamplingParams from SGLang-style ``sampling_params``; 400s name the key."""
    if sp is None:
        sp = {}
    if not isinstance(sp, Mapping):
        raise APIError("'sampling_params' must be an object", param="sampling_params")
    unknown = sorted(set(sp) - _SAMPLING_KEYS)
    if unknown:
        raise APIError(f"unsupported sampling_params keys {unknown}; supported: {sorted(_SAMPLING_KEYS)}",
                       param=f"sampling_params.{unknown[0]}", code="unsupported_parameter")

    def num(key: str, default: float, ok: Any, what: str) -> float:
        v = sp.get(key)
        if v is None:
            return default
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v)):
            raise APIError(f"'sampling_params.{key}' must be {what}, got {v!r}", param=f"sampling_params.{key}")
        return float(v)

    temperature = num("temperature", 1.0, lambda v: v >= 0, "a number >= 0")
    top_p = num("top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = sp.get("top_k", 0)
    if not _is_int(top_k) or top_k < -1:
        raise APIError(f"'sampling_params.top_k' must be an int >= -1 (0 or -1 disables it), got {top_k!r}",
                       param="sampling_params.top_k")
    room = srv.max_model_len - context_len
    default_max = room if srv.config.default_max_tokens is None else min(room, srv.config.default_max_tokens)
    max_new = sp.get("max_new_tokens")
    if max_new is None:
        max_new = max(1, default_max)
    elif not _is_int(max_new) or max_new < 1:
        raise APIError(f"'sampling_params.max_new_tokens' must be an int >= 1, got {max_new!r}",
                       param="sampling_params.max_new_tokens")
    elif max_new > srv.config.limits.max_tokens:
        raise APIError(f"'sampling_params.max_new_tokens'={max_new} exceeds this server's limit of "
                       f"{srv.config.limits.max_tokens} (ServeLimits.max_tokens)", param="sampling_params.max_new_tokens",
                       code="limit_exceeded")
    stop_ids: tuple[int, ...] | None = None
    if sp.get("stop_ids") is not None:
        stop_ids = tuple(_ids(sp["stop_ids"], "sampling_params.stop_ids", srv.vocab))
    if sp.get("stop_token_ids"):
        extra = _ids(sp["stop_token_ids"], "sampling_params.stop_token_ids", srv.vocab)
        stop_ids = tuple(sorted(set(srv.default_stop_ids if stop_ids is None else stop_ids) | set(extra)))
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(f"'sampling_params.ignore_eos' must be a boolean, got {ignore_eos!r}",
                       param="sampling_params.ignore_eos")
    seed = sp.get("seed", sp.get("sampling_seed"))
    if seed is not None and not _is_int(seed):
        raise APIError(f"'sampling_params.seed' must be an integer, got {seed!r}", param="sampling_params.seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=int(top_k), max_tokens=int(max_new),
                          stop_ids=stop_ids, seed=seed, ignore_eos=ignore_eos)


def _generation_request(body: Mapping[str, Any], srv: ServerState) -> GenerationRequest:
    if "text" in body and "input_ids" not in body:
        raise APIError("this server's /generate takes 'input_ids' (token ids), not 'text'", param="input_ids")
    prompt = _ids(body.get("input_ids"), "input_ids", srv.vocab)
    if not prompt:
        raise APIError("'input_ids' is empty", param="input_ids")
    rid = body.get("rid")
    if rid is None:
        rid = srv.runner.new_request_id("gen")
    elif not isinstance(rid, str) or not rid:
        raise APIError(f"'rid' must be a non-empty string, got {rid!r}", param="rid")
    cont = body.get("continuation") or {}
    if not isinstance(cont, Mapping):
        raise APIError("'continuation' must be an object with output_ids, output_logprobs, output_versions",
                       param="continuation")
    given = _ids(cont.get("output_ids", []), "continuation.output_ids", srv.vocab)
    logprobs, versions = cont.get("output_logprobs", []), cont.get("output_versions", [])
    if not isinstance(logprobs, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
        raise APIError("'continuation.output_logprobs' must be a list of numbers", param="continuation.output_logprobs")
    if not isinstance(versions, list) or not all(_is_int(v) for v in versions):
        raise APIError("'continuation.output_versions' must be a list of ints", param="continuation.output_versions")
    sampling = _sampling(body.get("sampling_params"), context_len=len(prompt) + len(given), srv=srv)
    try:
        return GenerationRequest(rid, prompt, sampling, given_ids=given, given_logprobs=logprobs, given_versions=versions)
    except ValueError as e:
        raise APIError(str(e), param="continuation" if given else "input_ids") from None


def _finish_reason(res: GenerationResult) -> dict[str, Any]:
    if res.finish_reason == "stop":
        return {"type": "stop", "matched": res.output_ids[-1] if res.output_ids else None}
    if res.finish_reason == "length":
        return {"type": "length", "length": res.num_tokens}
    return {"type": "abort", "message": "aborted by /abort_request"}


def generate_response(res: GenerationResult, *, given: int, return_logprob: bool, weight_version: int,
                      tokenizer: Any | None) -> dict[str, Any]:
    """The SGLang-shaped ``/generate`` response of a result (module doc)."""
    meta: dict[str, Any] = {
        "id": res.request_id, "finish_reason": _finish_reason(res), "prompt_tokens": len(res.prompt_ids),
        "completion_tokens": res.num_tokens, "given_tokens": given, "cached_tokens": 0,
        "versions": list(res.output_versions), "kv_versions": list(res.output_kv_versions),
        "weight_version": weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(res.output_ids, res.output_logprobs)]
    if res.routes is not None:  # k3post serve --record-routes
        meta["routes"] = encode_routes(res.routes)
    text = decode(tokenizer, res.output_ids) if tokenizer is not None else None
    return {"text": text, "output_ids": list(res.output_ids), "meta_info": meta}


# --------------------------------------------------------------------------- weights from disk


def read_weights_folder(model_path: str | Path, model_names: set[str]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The tensors of a folder's ``*.safetensors`` files, as (file name, {name: tensor}).

    Tensors named as the served model's parameters (``model_names``: in-memory names, what
    ``HTTPEngine.update_weights`` writes) are returned as they are, file by file. A Hugging
    Face checkpoint folder (``config.json`` + safetensors written by ``save_pretrained``,
    whose on-disk names may differ, e.g. per-expert tensors of a fused MoE) is loaded with
    ``from_pretrained`` instead and must match the model exactly (no missing, unexpected or
    mismatched tensor). Raises ValueError naming the folder, the unreadable file or the key.
    """
    from safetensors.torch import load_file

    folder = Path(model_path)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    out: list[tuple[str, dict[str, torch.Tensor]]] = []
    seen: dict[str, str] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - any read failure is the file's fault
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        for name in tensors:
            if name in seen:
                raise ValueError(f"{f}: tensor {name!r} is also in {seen[name]}")
            seen[name] = f.name
        out.append((f.name, tensors))
    unknown = [(fname, n) for fname, ts in out for n in ts if n not in model_names]
    if not unknown:
        return out
    if not (folder / "config.json").is_file():
        fname, name = unknown[0]
        raise ValueError(f"{fname}: tensor {name!r} is not a parameter or buffer of the served model")
    del out
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - a broken checkpoint is the user's input
        raise ValueError(f"{folder}: cannot load the checkpoint ({type(e).__name__}: {e})") from None
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(what) or ())
        if keys:
            raise ValueError(f"{folder}: the checkpoint does not match the served model: {what.replace('_', ' ')} "
                             f"{keys[:5]}{'...' if len(keys) > 5 else ''}")
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return [(folder.name + " (checkpoint)", {n: t.detach() for n, t in named.items() if n in model_names})]


def check_complete(model: torch.nn.Module, names: Any) -> None:
    """A weight update is all or nothing: ``names`` must cover every parameter and persistent buffer
    of ``model`` (`k3post.distributed.weight_sync.named_weights`; a tied weight under any of its
    names). ValueError naming the missing tensors (the first five and how many)."""
    from k3post.distributed.weight_sync import named_weights

    canonical: dict[str, str] = {}  # every name of a tied parameter -> its first name
    first: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        canonical[n] = first.setdefault(id(p), n)
    given = {canonical.get(n, n) for n in names}
    missing = [n for n, _ in named_weights(model) if n not in given]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"the update does not carry every weight of the served model: {len(missing)} missing "
                         f"({', '.join(missing[:5])}{more}); a weight update replaces all of them or none")


def apply_weights(engine: Any, files: list[tuple[str, dict[str, torch.Tensor]]], version: int | None) -> int:
    """Check ``files`` against ``engine.model`` (every parameter and persistent buffer present,
    `check_complete`; each tensor a known name, the same shape, the same dtype or both floating
    point (cast to the model's dtype when copied), finite values), then load them all with
    ``engine.update_weights`` (version: ``version``, else current + 1) and drop the KV the engine kept
    for finished requests. Nothing is copied when a check fails: the ValueError names the file and
    the tensor. Runs on the engine thread."""
    model = engine.model
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    named: dict[str, torch.Tensor] = {}
    for fname, tensors in files:
        for name, t in tensors.items():
            if name not in targets:
                raise ValueError(f"{fname}: tensor {name!r} is not a parameter or buffer of the served model")
            want = targets[name]
            if tuple(t.shape) != tuple(want.shape):
                raise ValueError(f"{fname}: tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                                 f"{tuple(want.shape)}")
            if t.dtype != want.dtype and not (t.is_floating_point() and want.is_floating_point()):
                raise ValueError(f"{fname}: tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, the "
                                 f"model expects {str(want.dtype).removeprefix('torch.')}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{fname}: tensor {name!r} holds non-finite values")
            named[name] = t
    check_complete(model, named)
    current = int(engine.version)
    if version is not None and version <= current:
        raise ValueError(f"weight_version {version} must exceed the current version {current}")
    new = int(engine.update_weights(named, version=version))
    drop = getattr(engine, "drop_kv", None)
    if callable(drop):
        drop()
    return new


# --------------------------------------------------------------------------- routes


def engine_router(srv: ServerState) -> APIRouter:
    """The engine-protocol routes (module doc) over ``srv``'s runner."""
    router = APIRouter()
    runner = srv.runner

    def version() -> int:
        return int(getattr(runner.engine, "version", 0))

    def qat_scheme() -> dict[str, Any] | None:
        from k3post.distributed.weight_sync import engine_qat

        cfg = engine_qat(runner.engine)
        return None if cfg is None else dataclasses.asdict(cfg)

    @router.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list):
            raise APIError("batched 'input_ids' are not supported: send one request per call", param="input_ids")
        return_logprob = body.get("return_logprob", False)
        if not isinstance(return_logprob, bool):
            raise APIError(f"'return_logprob' must be a boolean, got {return_logprob!r}", param="return_logprob")
        req = _generation_request(body, srv)
        try:
            result = await runner.generate(req)
        except ValueError as e:
            raise APIError(str(e)) from None
        except RuntimeError as e:
            raise APIError(str(e), status=500, type_="server_error") from None
        return generate_response(result, given=len(req.given_ids), return_logprob=return_logprob,
                                 weight_version=version(), tokenizer=srv.tokenizer)

    @router.post("/score")
    async def score(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        seqs = body.get("input_ids")
        if not isinstance(seqs, list) or not seqs:
            raise APIError("'input_ids' must be a non-empty list of non-empty token-id lists", param="input_ids")
        try:  # the engine layer's own check (what HTTPEngine.score runs before sending), with the server's bounds
            prompts = check_score_ids(seqs, srv.vocab, srv.max_model_len)
        except ValueError as e:
            raise APIError(f"'input_ids': {e}", param="input_ids") from None
        return {"logprobs": await srv.score(prompts), "weight_version": version()}

    @router.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if body.get("abort_all") is True:
            runner.abort_all(finish=True)
            return {"success": True}
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise APIError(f"'rid' must be a non-empty string, got {rid!r}", param="rid")
        runner.abort([rid], finish=True)
        return {"success": True}

    @router.post("/pause_generation")
    async def pause_generation() -> dict[str, Any]:
        await runner.pause_generation()
        return {"success": True}

    @router.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await runner.continue_generation()
        return {"success": True}

    @router.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        def flush(engine: Any) -> int:
            drop = getattr(engine, "drop_kv", None)
            return int(drop()) if callable(drop) else 0

        return {"success": True, "dropped_kv": await runner.call(flush)}

    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        path = srv.config.model_path
        path = Path(path).name if path else path  # the folder's name: no server paths for callers
        return {
            "model_path": path, "tokenizer_path": path, "is_generation": True, "model_name": srv.config.model_name,
            "max_model_len": srv.max_model_len, "max_batch_size": getattr(runner.engine, "max_batch_size", None),
            "vocab_size": srv.vocab, "weight_version": version(), "kv_transfer": False, "qat": qat_scheme(),
        }

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": version()}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        from k3post.distributed.weight_sync import MANIFEST, load_from_disk
        from k3post.distributed.weight_sync import apply_weights as apply_version

        body = await json_body(request)
        path = body.get("model_path")
        wv = body.get("weight_version")
        try:
            if not isinstance(path, str) or not path:
                raise ValueError(f"'model_path' must be a non-empty string, got {path!r}")
            if wv is not None and not _is_int(wv):
                raise ValueError(f"'weight_version' must be an integer or null, got {wv!r}")
            if (Path(path) / MANIFEST).is_file():  # a DiskSync version folder: checked shards, version, QAT scheme
                manifest, items = await asyncio.to_thread(load_from_disk, path)
                if wv is not None and wv != manifest.version:
                    raise ValueError(f"weight_version {wv} differs from the version {manifest.version} in {path}")
                def load(engine: Any) -> int:
                    check_complete(engine.model, (n for n, _ in items))
                    return apply_version(engine, items, manifest.version, qat=manifest.qat)

                new = await runner.call(load)
            else:
                model = runner.engine.model  # names only: the tensors are applied on the engine thread
                names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
                names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
                files = await asyncio.to_thread(read_weights_folder, path, names)  # file reads off the engine thread
                new = await runner.call(lambda engine: apply_weights(engine, files, wv))
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e), "weight_version": version()}, status_code=400)
        return JSONResponse({"success": True, "message": f"loaded {path}", "weight_version": new})

    groups: dict[str, Any] = {}  # group_name -> DistributedReceiver

    def failed(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message, "weight_version": version()}, status_code=400)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        from k3post.distributed.weight_sync import DistributedReceiver

        body = await json_body(request)
        try:
            addr, port, name = body.get("master_address"), body.get("master_port"), body.get("group_name", "weight_sync")
            rank, world, backend = body.get("rank_offset"), body.get("world_size"), body.get("backend", "gloo")
            timeout_s = body.get("timeout_s", 300.0)
            if not isinstance(addr, str) or not addr:
                raise ValueError(f"'master_address' must be a host name or address, got {addr!r}")
            if not _is_int(port) or not 0 < port < 65536:
                raise ValueError(f"'master_port' must be a port number, got {port!r}")
            if not _is_int(world) or world < 2:
                raise ValueError(f"'world_size' must be an int >= 2, got {world!r}")
            if not _is_int(rank) or not 1 <= rank < world:
                raise ValueError(f"'rank_offset' must be an int in [1, world_size) (rank 0 is the trainer), got {rank!r}")
            if not isinstance(name, str) or not name:
                raise ValueError(f"'group_name' must be a non-empty string, got {name!r}")
            if name in groups:
                raise ValueError(f"group {name!r} exists already: /destroy_weights_update_group first")
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"'backend' must be 'gloo' or 'nccl', got {backend!r}")
            if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
                raise ValueError(f"'timeout_s' must be a number > 0, got {timeout_s!r}")
            device = getattr(runner.engine, "device", "cpu") if backend == "nccl" else "cpu"
            if backend == "nccl" and torch.device(device).type != "cuda":
                raise ValueError("backend 'nccl' needs an engine on a CUDA device; this one runs on the CPU (use gloo)")
            groups[name] = None  # reserved while the rendezvous runs
            try:  # the rendezvous waits for every rank: off the event loop and the engine thread
                groups[name] = await asyncio.to_thread(DistributedReceiver, runner.engine, f"tcp://{addr}:{port}", rank,
                                                       world, device=device, timeout_s=float(timeout_s))
            except BaseException:
                groups.pop(name, None)
                raise
        except (ValueError, RuntimeError) as e:
            return failed(f"init_weights_update_group: {e}")
        return JSONResponse({"success": True, "message": f"joined group {name!r} as rank {rank} of {world}"})

    def expect(body: Mapping[str, Any]) -> Any:
        """The posted names / dtypes / shapes / weight_version as a check of the broadcast manifest."""
        names, dtypes, shapes, wv = body.get("names"), body.get("dtypes"), body.get("shapes"), body.get("weight_version")
        for key, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
            if v is not None and not isinstance(v, list):
                raise ValueError(f"'{key}' must be a list, got {type(v).__name__}")
        if wv is not None and not _is_int(wv):
            raise ValueError(f"'weight_version' must be an integer or null, got {wv!r}")

        def check(manifest: Any) -> None:
            got = manifest.tensors
            check_complete(runner.engine.model, (t.name for t in got))
            if wv is not None and manifest.version != wv:
                raise ValueError(f"the broadcast carries version {manifest.version}, the request says weight_version {wv}")
            for key, posted, sent in (("names", names, [t.name for t in got]),
                                      ("dtypes", dtypes, [t.dtype for t in got]),
                                      ("shapes", shapes, [list(t.shape) for t in got])):
                if posted is None:
                    continue
                posted = [str(x).removeprefix("torch.") for x in posted] if key == "dtypes" else posted
                if posted != sent:
                    i = next((i for i, (a, b) in enumerate(zip(posted, sent)) if a != b), min(len(posted), len(sent)))
                    raise ValueError(f"posted '{key}' differ from the broadcast manifest at entry {i} "
                                     f"({posted[i] if i < len(posted) else 'none'} vs {sent[i] if i < len(sent) else 'none'})")

        return check

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        from k3post.distributed.weight_sync import WeightSyncError

        body = await json_body(request)
        name = body.get("group_name", "weight_sync")
        flush = body.get("flush_cache", True)
        try:
            receiver = groups.get(name) if isinstance(name, str) else None
            if receiver is None:
                raise ValueError(f"no weight-sync group {name!r} here: /init_weights_update_group first")
            if not isinstance(flush, bool):
                raise ValueError(f"'flush_cache' must be a boolean, got {flush!r}")
            check = expect(body)

            def receive(engine: Any) -> Any:
                stats = receiver.receive(check)
                drop = getattr(engine, "drop_kv", None)
                if stats is not None and flush and callable(drop):
                    drop()
                return stats

            stats = await runner.call(receive)  # on the engine thread: no step runs while the weights arrive
        except (ValueError, WeightSyncError) as e:
            if isinstance(e, WeightSyncError) and getattr(groups.get(name), "broken", False):
                groups.pop(name).close()
                return failed(f"{e} (group {name!r} dropped: init a new one)")
            return failed(str(e))
        if stats is None:  # the trainer closed the group
            groups.pop(name).close()
            return failed(f"the trainer closed group {name!r}")
        return JSONResponse({"success": True, "message": f"{stats.bytes} bytes in {stats.buckets} buckets, "
                             f"{stats.seconds:.3f} s", "weight_version": stats.version, "stats": stats.as_dict()})

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await json_body(request)
        name = body.get("group_name", "weight_sync")
        receiver = groups.get(name) if isinstance(name, str) else None
        if receiver is None:
            return failed(f"no weight-sync group {name!r} here")
        groups.pop(name).close()
        return JSONResponse({"success": True, "message": f"left group {name!r}"})

    @router.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await json_body(request)
        name, n = body.get("name"), body.get("truncate_size", 100)
        if not _is_int(n) or n < 0:
            raise APIError(f"'truncate_size' must be an int >= 0, got {n!r}", param="truncate_size")
        cap = srv.config.limits.max_weight_values
        if n > cap:
            raise APIError(f"'truncate_size'={n} exceeds this server's limit of {cap} values "
                           "(ServeLimits.max_weight_values)", param="truncate_size", code="limit_exceeded")

        def read(engine: Any) -> tuple[list[int], str, list[Any]] | None:
            model = engine.model
            t = dict(model.named_parameters(remove_duplicate=False)).get(name)
            if t is None:
                t = dict(model.named_buffers(remove_duplicate=False)).get(name)
            if t is None:
                return None
            return list(t.shape), str(t.dtype).removeprefix("torch."), t.detach().reshape(-1)[:n].float().cpu().tolist()

        out = await runner.call(read)
        if out is None:
            raise APIError(f"{name!r} is not a parameter or buffer of the served model", param="name")
        shape, dtype, values = out
        return JSONResponse({"name": name, "shape": shape, "dtype": dtype, "values": values})

    return router
