"""Benchmark: the embedded rollout engine against ``transformers`` ``generate()`` (issue 6, part 5).

Setup: the tiny Qwen3-MoE (``build_tiny_moe``, preset "tiny") with a byte-level BPE trained
on ``default_corpus()`` (vocab 512); 32 XTML-rendered arithmetic prompts; sampling at
temperature 1, no top-k / top-p, with ``ignore_eos`` so every request produces exactly its
assigned length. Two workloads over the same prompts:

* drawn lengths (HEADLINE workload): per-request output lengths drawn heavy-tailed (lognormal,
  median ``--median-len``, sigma ``--sigma``, clipped to [4, ``--max-len``]), as RL rollouts are;
* equal lengths (control): every request the mean drawn length (rounded), so the useful tokens
  are the same up to rounding and HF's static batch wastes nothing on padding rows.

Arms:

* engine: ``EmbeddedEngine.generate`` over the 32 requests (32 slots, continuous batching:
  a finished request leaves the batch at once).
* HF baseline: ``model.generate`` on all 32 prompts (left-padded), ``max_new_tokens = max(lengths)``,
  ``do_sample=True``, temperature 1, no top-k / top-p, no EOS, as a user would call it: the batch
  runs to the longest request. Only the useful tokens (each request's own length) are counted.
  With QAT on, HF gets the same once-per-weight-version quantized expert weights as the engine
  (``HFBaseline``: a copy of the model holding ``quantized_expert_weights``, whose QAT forward
  skips re-quantizing them and still fake-quantizes the expert-GEMM inputs to MXFP8 every step,
  as the engine does); its logits are bit-identical to the re-quantizing QAT forward
  (tests/test_bench_rollout_engine.py, which also checks greedy tokens / log-probs against the
  engine).

What each ratio measures (``bench/common.py``: ``--repeats`` rounds, engine and HF interleaved
with the order rotated, ratio of medians with ``_min`` / ``_max`` over paired rounds and ``_n``):

* ``speedup_vs_hf_generate`` = median HF seconds / median engine seconds on the drawn lengths
  (= engine useful tokens/s over HF's): the engine's per-step efficiency AND continuous batching
  (HF pads finished rows until the longest request ends). Target >= 3 (README).
* ``speedup_vs_hf_generate_equal_len``: the same on the equal-length control: the engine's
  per-step efficiency only (lean forward, slot KV cache, no per-step ``generate()`` machinery);
  continuous batching has nothing to gain there.
* ``..._qat``: the same two with QAT on (``apply_qat``) on both sides, weights quantized once
  per weight version on both (the engine's prefill of many tokens calls the QAT-patched
  ``layer.mlp`` inside its own ``weight_quant_cache``).

Excluded from the timings: engine construction (slot-cache allocation), building HF's
pre-quantized copy (once per weight version), tokenizer / model setup, the warm-up runs
(4 prompts x 8 tokens per arm). Sampled tokens differ between the two sides (different RNGs);
the work per token does not depend on which token was sampled.

Peak memory: one run of each side (drawn lengths) in a fresh subprocess, where a sampler
thread reads the process RSS (/proc/self/statm) every 2 ms; reported as the peak minus the
RSS just before the run (MB) (``*_peak_rss_mb``; a fresh process keeps allocator reuse between
runs out of the number; the same sampler in the timing process gives ``*_inproc_peak_rss_mb``),
plus the KV-cache bytes each side holds at its largest (the engine's slot cache; HF's
DynamicCache of 32 x (padded prompt + max length) positions).

Caveats: a tiny model on a shared 2-core CPU, one torch thread by default. HF's pre-quantized
copy is built before its memory is measured (like the engine's, it holds one more copy of the
expert weights; the engine builds its own inside the measured run). ``machine``
(``machine_state()``) records the load average and CPU at the end of the run.

Prints human-readable lines, then one final JSON line: the four ratios first, then per workload
and QAT state (suffixes ``_equal_len``, ``_qat``) ``engine_tokens_per_s``, ``hf_tokens_per_s``,
seconds summaries, memory, ``wall_s`` and ``machine``.

Usage: python bench/rollout_engine.py [--repeats 3] [--threads 1] [--max-len 256]

Shape legend: B batch (prompts), T sequence length, N new tokens per row, V vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary, summary  # noqa: E402

import k3post.quant.qat as qat  # noqa: E402
from k3post.stages.sft_data import default_corpus  # noqa: E402
from k3post.envs.families import EFFORTS, get_family  # noqa: E402
from k3post.models import build_tiny_moe  # noqa: E402
from k3post.quant.qat import QATConfig, apply_qat, quantized_expert_weights, remove_qat  # noqa: E402
from k3post.rollout.embedded import EmbeddedEngine  # noqa: E402
from k3post.rollout.engine import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from k3post.tokenizer import train_tokenizer  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Context manager sampling the process RSS every ``interval`` seconds; ``.peak_delta``
    is max RSS during the block minus RSS at entry (bytes)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak_delta = 0
        self._base = 0
        self._peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._base = _rss_bytes()
        self._peak = self._base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, _rss_bytes())
        self.peak_delta = self._peak - self._base


def draw_lengths(n: int, *, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """n heavy-tailed output lengths: round(lognormal(log median, sigma)) clipped to [lo, hi]."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_prompts(tok: Any, n: int, seed: int) -> list[list[int]]:
    """n XTML-rendered ``general.arithmetic`` prompts (think mode, efforts cycling)."""
    xtml = XTML(tok)
    tasks = get_family("general.arithmetic").generate(n, seed=seed)
    return [
        xtml.render(list(t.messages), effort=EFFORTS[i % len(EFFORTS)], add_generation_prompt=True).ids
        for i, t in enumerate(tasks)
    ]


def engine_generate(model: Any, tok: Any, prompts: list[list[int]], lengths: list[int], seed: int, *,
                    temperature: float = 1.0) -> tuple[float, list[GenerationResult], int]:
    """(seconds, results, KV-cache bytes) of one ``EmbeddedEngine.generate`` over all prompts, one slot
    per prompt, request i producing exactly ``lengths[i]`` tokens (``ignore_eos``)."""
    engine = EmbeddedEngine(model, tok, max_batch_size=len(prompts), max_model_len=max(map(len, prompts)) + max(lengths) + 1)
    reqs = [
        GenerationRequest(
            f"p{i}", p, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=seed * 1000 + i)
        )
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t0
    got = [r.num_tokens for r in res]
    assert got == lengths, (got, lengths)
    return dt, res, engine.cache.nbytes


def run_engine(model: Any, tok: Any, prompts: list[list[int]], lengths: list[int], seed: int) -> tuple[float, int, int]:
    """(seconds, useful tokens, KV-cache bytes) of one EmbeddedEngine.generate over all prompts."""
    dt, res, kv = engine_generate(model, tok, prompts, lengths, seed)
    return dt, sum(r.num_tokens for r in res), kv


def hf_generate(model: Any, pad: int, prompts: list[list[int]], max_new: int, seed: int, *, greedy: bool = False,
                logprobs: bool = False) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """(seconds, new ids [B, max_new], raw-model log-probs of them [B, max_new] if ``logprobs``) of one
    batched ``model.generate`` over all prompts (left-padded), exactly ``max_new`` tokens per row, no EOS."""
    P = max(map(len, prompts))
    ids_BT = torch.full((len(prompts), P), pad, dtype=torch.long)
    att_BT = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BT[i, P - len(p) :] = torch.tensor(p)
        att_BT[i, P - len(p) :] = 1
    sampling: dict[str, Any] = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids_BT, attention_mask=att_BT, max_new_tokens=max_new, min_new_tokens=max_new,
            eos_token_id=None, pad_token_id=pad, output_logits=logprobs, return_dict_in_generate=True, **sampling,
        )
    dt = time.perf_counter() - t0
    new_BN = out.sequences[:, P:]
    assert new_BN.shape == (len(prompts), max_new), out.sequences.shape
    logp_BN = None
    if logprobs:
        logits_BNV = torch.stack(out.logits, dim=1).float()
        logp_BN = torch.log_softmax(logits_BNV, dim=-1).gather(2, new_BN[:, :, None])[:, :, 0]
    return dt, new_BN, logp_BN


class HFBaseline:
    """What ``generate`` runs: ``model`` with its forward called inside ``context()``.

    ``HFBaseline.of(model)``: the model itself when QAT is off; under QAT a copy whose routed-expert
    weights were fake-quantized ONCE (``quantized_expert_weights``, i.e. once per weight version, as
    the engine's dense MoE holds them), with QAT applied with the same ``QATConfig`` and, inside
    ``context()``, ``qat.qat_fake_quant`` skipping exactly those weight tensors: the QAT forward then
    rounds only the expert-GEMM inputs (MXFP8), as the engine does per step. Same numbers as the
    re-quantizing forward: ``fake_quant_mx`` is the forward value of ``qat_fake_quant`` and
    ``quantized_expert_weights`` calls it with the same format, block and axis (bit-identical logits,
    tests/test_bench_rollout_engine.py)."""

    def __init__(self, model: Any, prequantized_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.prequantized_ids = prequantized_ids

    @staticmethod
    def of(model: Any) -> "HFBaseline":
        cfgs = [getattr(m, qat._CFG_ATTR) for m in model.modules() if hasattr(m, qat._CFG_ATTR)]
        if not cfgs:
            return HFBaseline(model)
        if any(c is not cfgs[0] for c in cfgs):
            raise ValueError("HFBaseline expects one QATConfig for the whole model (as apply_qat sets)")
        wq = quantized_expert_weights(model)
        hf = copy.deepcopy(model)
        remove_qat(hf)  # the deep copy carries the instance forwards bound to the copy; re-apply cleanly
        params = dict(hf.named_parameters())
        with torch.no_grad():
            for name, w in wq.items():
                params[name].copy_(w)
        apply_qat(hf, cfgs[0])
        return HFBaseline(hf.eval(), frozenset(id(params[name]) for name in wq))

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if not self.prequantized_ids:
            yield
            return
        inner, skip = qat.qat_fake_quant, self.prequantized_ids

        def fake_quant(x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1) -> torch.Tensor:
            return x if id(x) in skip else inner(x, fmt, block_size, axis)

        qat.qat_fake_quant = fake_quant
        try:
            yield
        finally:
            qat.qat_fake_quant = inner

    def generate(self, pad: int, prompts: list[list[int]], max_new: int, seed: int,
                 **kw: Any) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        with self.context():
            return hf_generate(self.model, pad, prompts, max_new, seed, **kw)


def run_hf(hf: HFBaseline, tok: Any, prompts: list[list[int]], lengths: list[int], seed: int) -> tuple[float, int, int]:
    """(seconds, useful tokens, KV-cache bytes) of one batched ``generate`` over all prompts: the
    batch runs to the longest request; only each request's own length counts as useful."""
    P, max_new = max(map(len, prompts)), max(lengths)
    dt, _, _ = hf.generate(tok.pad_token_id, prompts, max_new, seed)
    cfg = hf.model.config
    kv_bytes = 2 * cfg.num_hidden_layers * len(prompts) * cfg.num_key_value_heads * (P + max_new) * cfg.head_dim * 4
    return dt, sum(lengths), int(kv_bytes)


def compare(model: Any, hf: HFBaseline, tok: Any, prompts: list[list[int]], lengths: list[int], repeats: int,
            tag: str) -> dict[str, float]:
    """Engine vs HF over one workload (after one short warm-up each), ``repeats`` interleaved rounds
    (``bench/common.py``); ``speedup_vs_hf_generate`` = median HF seconds / median engine seconds
    (same useful tokens), min-max over paired rounds."""
    run_engine(model, tok, prompts[:4], [8] * 4, seed=99)
    run_hf(hf, tok, prompts[:4], [8] * 4, seed=99)
    useful = sum(lengths)
    rec: dict[str, dict[str, Any]] = {"engine": {"mem": [], "kv": 0, "n": 0}, "hf": {"mem": [], "kv": 0, "n": 0}}

    def arm(name: str) -> float:
        r = rec[name]
        with PeakRSS() as mem:
            if name == "engine":
                dt, n, kv = run_engine(model, tok, prompts, lengths, seed=r["n"])
            else:
                dt, n, kv = run_hf(hf, tok, prompts, lengths, seed=r["n"])
        assert n == useful
        r["n"] += 1
        r["mem"].append(mem.peak_delta)
        r["kv"] = kv
        print(f"[{tag}] run {r['n'] - 1} {name:6s}: {dt:6.2f} s  {useful / dt:8.1f} useful tok/s  "
              f"peak RSS +{mem.peak_delta / 2**20:.1f} MB", flush=True)
        return dt

    times = interleaved({"engine": lambda: arm("engine"), "hf": lambda: arm("hf")}, repeats=repeats, warmup=0)
    out: dict[str, float] = ratio_summary("speedup_vs_hf_generate", times["hf"], times["engine"])
    out.update(summary("engine_seconds", times["engine"]))
    out.update(summary("hf_seconds", times["hf"]))
    out.update(
        engine_tokens_per_s=useful / out["engine_seconds_median"],
        hf_tokens_per_s=useful / out["hf_seconds_median"],
        engine_inproc_peak_rss_mb=max(rec["engine"]["mem"]) / 2**20,
        hf_inproc_peak_rss_mb=max(rec["hf"]["mem"]) / 2**20,
        engine_kv_cache_mb=rec["engine"]["kv"] / 2**20,
        hf_kv_cache_mb=rec["hf"]["kv"] / 2**20,
        useful_tokens=float(useful),
        max_length=float(max(lengths)),
    )
    print(f"[{tag}] speedup_vs_hf_generate {out['speedup_vs_hf_generate']:.2f}x (paired min-max "
          f"{out['speedup_vs_hf_generate_min']:.2f}-{out['speedup_vs_hf_generate_max']:.2f}, n={repeats}); engine "
          f"{out['engine_tokens_per_s']:.1f} tok/s, HF {out['hf_tokens_per_s']:.1f} tok/s", flush=True)
    return out


def equal_lengths(lengths: list[int]) -> list[int]:
    """The equal-length control: every request the mean drawn length (rounded), so the useful tokens
    match the drawn workload's up to rounding and a static batch wastes nothing."""
    return [max(1, round(sum(lengths) / len(lengths)))] * len(lengths)


def _setup(args: argparse.Namespace, tok: Any) -> tuple[Any, list[list[int]], list[int]]:
    eom = tok.convert_tokens_to_ids("<|end_of_msg|>")
    model = build_tiny_moe(len(tok), seed=args.seed, pad_token_id=tok.pad_token_id, eos_token_id=eom).eval()
    prompts = make_prompts(tok, args.prompts, seed=args.seed + 1)
    lengths = draw_lengths(args.prompts, median=args.median_len, sigma=args.sigma, lo=4, hi=args.max_len, seed=args.seed + 2)
    return model, prompts, lengths


def memory_child(args: argparse.Namespace) -> None:
    """One run of one side in a fresh process: print {"peak_rss_mb": peak RSS during the
    run minus RSS before it}. A fresh process keeps allocator reuse across runs out of it."""
    from k3post.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.tokenizer_dir)
    model, prompts, lengths = _setup(args, tok)
    if args.qat:
        apply_qat(model, QATConfig())
    if args.memory_child == "engine":
        with PeakRSS() as mem:
            run_engine(model, tok, prompts, lengths, seed=0)
    else:
        hf = HFBaseline.of(model)  # the pre-quantized copy is built before the measured run, as in the timing
        with PeakRSS() as mem:
            run_hf(hf, tok, prompts, lengths, seed=0)
    print(json.dumps({"peak_rss_mb": mem.peak_delta / 2**20}))


def measure_memory(args: argparse.Namespace, tok_dir: str, qat_on: bool) -> dict[str, float]:
    """Peak RSS growth of one engine run and one HF run (drawn lengths), each in its own subprocess."""
    import subprocess

    out: dict[str, float] = {}
    for side in ("engine", "hf"):
        cmd = [sys.executable, __file__, "--memory-child", side, "--tokenizer-dir", tok_dir, "--threads", str(args.threads),
               "--prompts", str(args.prompts), "--median-len", str(args.median_len), "--sigma", str(args.sigma),
               "--max-len", str(args.max_len), "--seed", str(args.seed)] + (["--qat"] if qat_on else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[f"{side}_peak_rss_mb"] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    print(f"peak RSS growth during one run ({'QAT on' if qat_on else 'QAT off'}, fresh process each): "
          f"engine +{out['engine_peak_rss_mb']:.1f} MB, HF generate +{out['hf_peak_rss_mb']:.1f} MB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared 2-core box)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--median-len", type=float, default=40.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-qat", action="store_true", help="skip the QAT-on comparison")
    ap.add_argument("--memory-child", choices=("engine", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    ap.add_argument("--qat", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args)
        return
    if args.repeats < 3 or args.prompts < 1 or args.max_len < 4:
        raise ValueError("--repeats must be >= 3, --prompts >= 1 and --max-len >= 4")
    torch.set_num_threads(args.threads)

    tok_dir = tempfile.mkdtemp(prefix="k3post-bench-tok-")
    try:
        _main(args, tok_dir)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)


def _main(args: argparse.Namespace, tok_dir: str) -> None:
    t_start = time.perf_counter()
    tok = train_tokenizer(default_corpus(), vocab_size=512, out_dir=tok_dir)
    model, prompts, lengths = _setup(args, tok)
    equal = equal_lengths(lengths)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; drawn output lengths "
          f"sum {sum(lengths)}, median {statistics.median(lengths)}, max {max(lengths)}: {sorted(lengths)}; "
          f"equal-length control: {equal[0]} each (sum {sum(equal)})")

    sections: dict[str, dict[str, float]] = {}
    hf = HFBaseline.of(model)
    sections[""] = compare(model, hf, tok, prompts, lengths, args.repeats, "QAT off, drawn lengths")
    sections["_equal_len"] = compare(model, hf, tok, prompts, equal, args.repeats, "QAT off, equal lengths")
    sections[""].update(measure_memory(args, tok_dir, qat_on=False))
    if not args.no_qat:
        apply_qat(model, QATConfig())
        hf_qat = HFBaseline.of(model)  # once per weight version, outside the timings
        sections["_qat"] = compare(model, hf_qat, tok, prompts, lengths, args.repeats, "QAT on, drawn lengths")
        sections["_equal_len_qat"] = compare(model, hf_qat, tok, prompts, equal, args.repeats, "QAT on, equal lengths")
        remove_qat(model)
        sections["_qat"].update(measure_memory(args, tok_dir, qat_on=True))

    result: dict[str, Any] = {}
    for suffix, sec in sections.items():  # the ratios first
        for k in ("", "_min", "_max", "_n"):
            result[f"speedup_vs_hf_generate{suffix}{k}"] = sec.pop(f"speedup_vs_hf_generate{k}")
    for suffix, sec in sections.items():
        result.update({f"{k}{suffix}": v for k, v in sec.items()})
    for suffix in sections:
        k = f"speedup_vs_hf_generate{suffix}"
        note = " (target >= 3)" if "equal" not in suffix else " (control: no padding waste)"
        print(f"{k}: {result[k]:.2f}x, paired min-max {result[k + '_min']:.2f}-{result[k + '_max']:.2f}{note}")
    result.update(
        threads=float(torch.get_num_threads()),
        process_max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        wall_s=time.perf_counter() - t_start,
        machine=machine_state(),
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
