"""vLLM and SGLang behind the rollout-engine protocol (thin, lazily imported, GPU only).

Neither library is a dependency of k3post: ``VLLMEngine`` / ``SGLangEngine`` import them on
construction and raise an ImportError naming the package to install when they are absent.
All request / response conversion lives in pure functions (``to_vllm_sampling_kwargs``,
``from_vllm_output``, ``to_sglang_sampling_params``, ``from_sglang_output``) that are
unit-tested on CPU with objects shaped like the libraries' outputs.

Both engines run a blocking ``generate``: nothing is in flight between calls, so
``pause`` / ``abort`` only accept an empty id list (anything else is a ValueError);
a partial-rollout scheduler that needs mid-generation pause uses ``EmbeddedEngine`` or
drives these servers' own async APIs. ``resume`` of a paused trajectory is a
re-submission: ``GenerationRequest.continuation(result, sampling)`` sends prompt + given
tokens as the prompt (the given tokens keep their recorded log-probs / versions).

Log-prob conventions: vLLM returns the raw model log-probs with ``logprobs_mode=
"raw_logprobs"`` (its default in v1); SGLang returns log-probs of the temperature-scaled
distribution unless started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (set that for RL).

Shape legend: none (lists of token ids and floats only).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from k3post.rollout.engine import GenerationRequest, GenerationResult, NamedTensors, SamplingParams

__all__ = [
    "check_score_rows",
    "from_sglang_input_logprobs",
    "from_vllm_prompt_logprobs",
    "VLLMEngine",
    "SGLangEngine",
    "import_optional",
    "to_vllm_sampling_kwargs",
    "from_vllm_output",
    "to_sglang_sampling_params",
    "from_sglang_output",
    "normalize_finish_reason",
]


def import_optional(module: str, extra: str) -> Any:
    """Import ``module`` or raise an ImportError that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is not installed; the {module} rollout adapter needs it (a CUDA machine and "
            f"`pip install {extra}`), or use k3post.rollout.EmbeddedEngine instead"
        ) from e


def normalize_finish_reason(reason: Any) -> str:
    """Map a library finish reason (str, SGLang's {"type": ...} dict, or None) onto
    "stop" | "length" | "abort"."""
    if isinstance(reason, Mapping):
        reason = reason.get("type")
    if reason in ("stop", "eos", "stop_token"):
        return "stop"
    if reason in ("length", "max_tokens"):
        return "length"
    if reason in ("abort", None):
        return "abort"
    raise ValueError(f"unknown finish reason {reason!r}")


def _stop_ids(sp: SamplingParams, default_stop_ids: Sequence[int]) -> list[int]:
    if sp.ignore_eos:
        return []
    return sorted(sp.stop_ids if sp.stop_ids is not None else default_stop_ids)


def _context(req: GenerationRequest) -> list[int]:
    return list(req.prompt_ids) + list(req.given_ids)


def to_vllm_sampling_kwargs(req: GenerationRequest, default_stop_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request: one log-prob per token
    (``logprobs=0``: the sampled token's), no detokenisation, our stop ids; max_tokens
    counts the given continuation tokens as already produced."""
    sp = req.sampling
    return dict(
        n=1,
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=sp.top_k if sp.top_k > 0 else -1,
        max_tokens=sp.max_tokens - len(req.given_ids),
        stop_token_ids=_stop_ids(sp, default_stop_ids),
        ignore_eos=sp.ignore_eos,
        seed=sp.seed,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
    )


def from_vllm_output(req: GenerationRequest, output: Any, version: int) -> GenerationResult:
    """A ``vllm.RequestOutput`` (``.outputs[0]`` with ``token_ids``, ``logprobs`` = per token
    a dict {token id: Logprob(logprob=...)}, ``finish_reason``) -> GenerationResult."""
    comp = output.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    if comp.logprobs is None or len(comp.logprobs) != len(ids):
        raise ValueError(f"request {req.request_id!r}: vLLM returned no per-token logprobs (set logprobs=0)")
    lps = []
    for tok, step in zip(ids, comp.logprobs):
        entry = step[tok]
        lps.append(float(entry.logprob if hasattr(entry, "logprob") else entry))
    return GenerationResult(
        request_id=req.request_id,
        prompt_ids=list(req.prompt_ids),
        output_ids=list(req.given_ids) + ids,
        output_logprobs=list(req.given_logprobs) + lps,
        output_versions=list(req.given_versions) + [version] * len(ids),
        finish_reason=normalize_finish_reason(comp.finish_reason),  # type: ignore[arg-type]
    )


def to_sglang_sampling_params(req: GenerationRequest, default_stop_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang ``sampling_params`` dict for one request."""
    sp = req.sampling
    out: dict[str, Any] = dict(
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=sp.top_k if sp.top_k > 0 else -1,
        max_new_tokens=sp.max_tokens - len(req.given_ids),
        stop_token_ids=_stop_ids(sp, default_stop_ids),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=False,
    )
    if sp.seed is not None:
        out["sampling_seed"] = sp.seed
    return out


def from_sglang_output(req: GenerationRequest, output: Mapping[str, Any], version: int) -> GenerationResult:
    """One item of ``sglang.Engine.generate(..., return_logprob=True)``: ``meta_info``
    holds ``output_token_logprobs`` = [(logprob, token id, text or None), ...] and
    ``finish_reason`` ({"type": "stop" | "length" | "abort", ...})."""
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping) or "output_token_logprobs" not in meta:
        raise ValueError(f"request {req.request_id!r}: SGLang output has no meta_info.output_token_logprobs "
                         f"(call generate with return_logprob=True)")
    triples = meta["output_token_logprobs"]
    ids = [int(t[1]) for t in triples]
    lps = [float(t[0]) for t in triples]
    if "output_ids" in output and list(output["output_ids"]) != ids:
        raise ValueError(f"request {req.request_id!r}: SGLang output_ids disagree with output_token_logprobs")
    return GenerationResult(
        request_id=req.request_id,
        prompt_ids=list(req.prompt_ids),
        output_ids=list(req.given_ids) + ids,
        output_logprobs=list(req.given_logprobs) + lps,
        output_versions=list(req.given_versions) + [version] * len(ids),
        finish_reason=normalize_finish_reason(meta.get("finish_reason")),  # type: ignore[arg-type]
    )


def check_score_rows(ids: Sequence[Sequence[int]], rows: Any) -> list[list[float]]:
    """``rows`` (an answer's log-probs per sequence, without the first token's) checked against the scored ``ids``:
    one row per sequence, ``len(ids[b]) - 1`` finite numbers each; ValueError naming the sequence otherwise."""
    if not isinstance(rows, list) or len(rows) != len(ids):
        raise ValueError(f"expected {len(ids)} rows of log-probs, got {str(rows)[:200]}")
    out = []
    for b, (seq, row) in enumerate(zip(ids, rows)):
        n = len(seq)
        if not isinstance(row, list) or len(row) != n - 1 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row):
            raise ValueError(f"sequence {b} ({n} tokens): expected {n - 1} finite log-probs, got {str(row)[:200]}")
        out.append([float(x) for x in row])
    return out


def from_vllm_prompt_logprobs(ids: Sequence[Sequence[int]], outputs: Sequence[Any]) -> list[list[float]]:
    """`ScoringEngine.score` rows from ``vllm.LLM.generate`` outputs run with ``prompt_logprobs=0``: each
    output's ``prompt_logprobs`` holds None for the first token, then per position a mapping token id ->
    ``Logprob`` that includes the prompt's own token. ValueError naming the sequence when one is missing."""
    if len(outputs) != len(ids):
        raise ValueError(f"expected {len(ids)} outputs, got {len(outputs)}")
    rows = []
    for b, (seq, out) in enumerate(zip(ids, outputs)):
        plp = getattr(out, "prompt_logprobs", None)
        if not isinstance(plp, (list, tuple)) or len(plp) != len(seq):
            raise ValueError(f"sequence {b}: prompt_logprobs {str(plp)[:120]} do not cover its {len(seq)} tokens "
                             "(run with prompt_logprobs=0)")
        row = []
        for t in range(1, len(seq)):
            entry = plp[t].get(seq[t]) if isinstance(plp[t], Mapping) else None
            if entry is None:
                raise ValueError(f"sequence {b}, position {t}: no log-prob of its token {seq[t]}")
            row.append(getattr(entry, "logprob", entry))
        rows.append(row)
    return check_score_rows(ids, rows)


def from_sglang_input_logprobs(ids: Sequence[Sequence[int]], outputs: Any) -> list[list[float]]:
    """`ScoringEngine.score` rows from SGLang answers run with ``return_logprob``, ``logprob_start_len`` 0 and
    ``max_new_tokens`` 0 (the offline ``Engine.generate`` and the HTTP ``/generate`` answer alike): each answer's
    ``meta_info.input_token_logprobs`` is ``[logprob, token_id, text]`` per input token, no log-prob for the
    first. The token ids must be the ones sent; ValueError naming the sequence otherwise."""
    answers = [outputs] if isinstance(outputs, Mapping) else list(outputs)
    if len(answers) != len(ids):
        raise ValueError(f"expected {len(ids)} answers, got {len(answers)}")
    rows = []
    for b, (seq, a) in enumerate(zip(ids, answers)):
        entries = a["meta_info"]["input_token_logprobs"]
        if not isinstance(entries, list) or len(entries) != len(seq) or any(
                not isinstance(e, (list, tuple)) or len(e) < 2 or int(e[1]) != t for e, t in zip(entries, seq)):
            raise ValueError(f"sequence {b}: meta_info.input_token_logprobs do not cover its {len(seq)} input tokens: "
                             f"{str(entries)[:200]}")
        rows.append([e[0] for e in entries[1:]])
    return check_score_rows(ids, rows)


def _named_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError("update_weights takes (name: str, tensor) pairs or a {name: tensor} mapping")
    return items


class _BlockingEngine:
    """Shared protocol plumbing of the blocking adapters."""

    _version: int = 0

    @property
    def version(self) -> int:
        """Policy version stamped on sampled tokens (bumped by ``update_weights``)."""
        return self._version

    def pause(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Nothing is in flight between blocking ``generate`` calls: only [] is valid."""
        if list(request_ids):
            raise ValueError(f"{type(self).__name__} runs blocking generate(); requests {list(request_ids)} are not in flight")
        return []

    def resume(self, request_ids: Sequence[str]) -> None:
        """Resume is re-submission (``GenerationRequest.continuation``); only [] is valid."""
        if list(request_ids):
            raise ValueError(f"{type(self).__name__} keeps no paused requests; re-submit continuations with generate()")

    def abort(self, request_ids: Sequence[str]) -> list[GenerationResult]:
        """Nothing is in flight between blocking ``generate`` calls: only [] is valid."""
        return self.pause(request_ids)

    def _bump(self, version: int | None) -> int:
        if version is not None and version <= self._version:
            raise ValueError(f"update_weights: version {version} must exceed the current version {self._version}")
        self._version = self._version + 1 if version is None else int(version)
        return self._version


def _vllm_load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (``collective_rpc``): load HF-named weights in place."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine(_BlockingEngine):
    """``vllm.LLM`` behind the protocol.

    Args:
        model_dir: a local HF model folder (k3post.models.save_model output).
        stop_ids: default stop ids (None: the ``<|end_of_msg|>`` id of the folder's tokenizer).
        engine_kwargs: passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``,
            ``enforce_eager``).
    """

    def __init__(self, model_dir: str | Path, *, stop_ids: Sequence[int] | None = None, **engine_kwargs: Any) -> None:
        vllm = import_optional("vllm", "vllm")
        self._vllm = vllm
        self._llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=False, **engine_kwargs)
        self.default_stop_ids = list(stop_ids) if stop_ids is not None else _eom_ids(model_dir)
        self._version = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``LLM.generate`` on token-id prompts (prompt + given tokens)."""
        prompts = [{"prompt_token_ids": _context(r)} for r in requests]
        params = [self._vllm.SamplingParams(**to_vllm_sampling_kwargs(r, self.default_stop_ids)) for r in requests]
        outs = self._llm.generate(prompts, params, use_tqdm=False)
        return [from_vllm_output(r, o, self._version) for r, o in zip(requests, outs)]

    def score(self, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """`ScoringEngine.score`: ``LLM.generate`` with ``prompt_logprobs=0`` and one greedy token (ignored)."""
        seqs = [list(map(int, s)) for s in ids]
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        return from_vllm_prompt_logprobs(seqs, outs)

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Load weights into every worker's model (``collective_rpc`` -> ``model.load_weights``;
        vLLM v1 needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to ship the function) and drop
        the prefix cache, whose entries were computed with the old weights."""
        items = _named_list(named_tensors)
        self._llm.collective_rpc(_vllm_load_weights, args=(items,))
        self._llm.reset_prefix_cache()
        return self._bump(version)


class SGLangEngine(_BlockingEngine):
    """``sglang.Engine`` (offline engine) behind the protocol.

    Args:
        model_dir: a local HF model folder.
        stop_ids: default stop ids (None: the folder tokenizer's ``<|end_of_msg|>``).
        engine_kwargs: passed to ``sglang.Engine`` (e.g. ``mem_fraction_static``).
    """

    def __init__(self, model_dir: str | Path, *, stop_ids: Sequence[int] | None = None, **engine_kwargs: Any) -> None:
        sglang = import_optional("sglang", "'sglang[all]'")
        self._engine = sglang.Engine(model_path=str(model_dir), **engine_kwargs)
        self.default_stop_ids = list(stop_ids) if stop_ids is not None else _eom_ids(model_dir)
        self._version = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)``."""
        outs = self._engine.generate(
            input_ids=[_context(r) for r in requests],
            sampling_params=[to_sglang_sampling_params(r, self.default_stop_ids) for r in requests],
            return_logprob=True,
        )
        if isinstance(outs, Mapping):
            outs = [outs]
        return [from_sglang_output(r, o, self._version) for r, o in zip(requests, outs)]

    def score(self, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """`ScoringEngine.score`: a prefill-only ``Engine.generate`` (``max_new_tokens`` 0) with the input's
        log-probs from its first token."""
        seqs = [list(map(int, s)) for s in ids]
        outs = self._engine.generate(input_ids=seqs, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                     logprob_start_len=0)
        return from_sglang_input_logprobs(seqs, outs)

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """``Engine.update_weights_from_tensor`` (flushes the radix cache)."""
        items = _named_list(named_tensors)
        self._engine.update_weights_from_tensor(named_tensors=items, flush_cache=True)
        return self._bump(version)

    def shutdown(self) -> None:
        """Stop SGLang's scheduler processes."""
        self._engine.shutdown()


def _eom_ids(model_dir: str | Path) -> list[int]:
    """The ``<|end_of_msg|>`` id of the tokenizer saved with the model."""
    from k3post.tokenizer import load_tokenizer
    from k3post.xtml import EOM

    tok = load_tokenizer(model_dir)
    eom = tok.convert_tokens_to_ids(EOM)
    if not isinstance(eom, int) or eom == getattr(tok, "unk_token_id", None):
        raise ValueError(f"{model_dir}: the tokenizer has no {EOM} token; pass stop_ids explicitly")
    return [int(eom)]
