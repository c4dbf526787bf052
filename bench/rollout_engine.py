"""Benchmark: the embedded rollout engine against ``transformers`` ``generate()`` (issue 6, part 5).

Setup: the tiny Qwen3-MoE (``build_tiny_moe``, preset "tiny") with a byte-level BPE trained
on ``default_corpus()`` (vocab 512); 32 XTML-rendered arithmetic prompts; per-request output
lengths drawn heavy-tailed (lognormal, median ``--median-len``, sigma ``--sigma``, clipped to
[4, ``--max-len``]); sampling at temperature 1 with ``ignore_eos`` so every request produces
exactly its drawn length.

* engine: ``EmbeddedEngine.generate`` over the 32 requests (32 slots, continuous batching:
  a finished request leaves the batch at once).
* HF baseline: ``model.generate`` on all 32 prompts (left-padded) with
  ``max_new_tokens = max(lengths)``, ``do_sample=True``, temperature 1, no top-k / top-p, no
  EOS, as a user would call it: the batch runs to the longest request. Only the useful
  tokens (each request's own length) are counted.

tokens/s = sum(lengths) / wall time, median over ``--repeats`` runs, engine and HF
interleaved in one process so machine load hits both alike. ``speedup_vs_hf_generate`` =
engine tokens/s / HF tokens/s (target >= 3). Both QAT off and QAT on (``apply_qat``; the
engine and ``generate`` then call the same MX fake-quant expert forward).

Peak memory: one run of each side in a fresh subprocess, where a sampler thread reads the
process RSS (/proc/self/statm) every 2 ms; reported as the peak minus the RSS just before
the run (MB) (``*_peak_rss_mb``; a fresh process keeps allocator reuse between runs out of
the number; the same sampler in the timing process gives ``*_inproc_peak_rss_mb``), plus
the KV-cache bytes each side holds at its largest (the engine's slot cache; HF's
DynamicCache of 32 x (padded prompt + max length) positions).

Prints human-readable lines, then one final JSON line with ``speedup_vs_hf_generate``,
``engine_tokens_per_s``, ``hf_tokens_per_s``, ``engine_peak_rss_mb``, ``hf_peak_rss_mb``,
``engine_kv_cache_mb``, ``hf_kv_cache_mb`` and the same keys with a ``_qat`` suffix.

Usage: python bench/rollout_engine.py [--repeats 3] [--threads 1] [--max-len 256]

Shape legend: B batch (prompts), T sequence length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from k3post.commands import default_corpus
from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat, remove_qat
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import GenerationRequest, SamplingParams
from k3post.envs.families import EFFORTS, get_family
from k3post.tokenizer import train_tokenizer
from k3post.xtml import XTML

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


def run_engine(model: Any, tok: Any, prompts: list[list[int]], lengths: list[int], seed: int) -> tuple[float, int, int]:
    """(seconds, useful tokens, KV-cache bytes) of one EmbeddedEngine.generate over all prompts."""
    engine = EmbeddedEngine(model, tok, max_batch_size=len(prompts), max_model_len=max(map(len, prompts)) + max(lengths) + 1)
    reqs = [
        GenerationRequest(f"p{i}", p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=seed * 1000 + i))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t0
    got = [r.num_tokens for r in res]
    assert got == lengths, (got, lengths)
    return dt, sum(got), engine.cache.nbytes


def run_hf(model: Any, tok: Any, prompts: list[list[int]], lengths: list[int], seed: int) -> tuple[float, int, int]:
    """(seconds, useful tokens, KV-cache bytes) of one batched ``generate`` over all prompts."""
    pad = tok.pad_token_id
    P = max(map(len, prompts))
    ids_BT = torch.full((len(prompts), P), pad, dtype=torch.long)
    att_BT = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BT[i, P - len(p) :] = torch.tensor(p)
        att_BT[i, P - len(p) :] = 1
    max_new = max(lengths)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids_BT, attention_mask=att_BT, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=pad,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == P + max_new, out.shape
    cfg = model.config
    kv_bytes = 2 * cfg.num_hidden_layers * len(prompts) * cfg.num_key_value_heads * (P + max_new) * cfg.head_dim * 4
    return dt, sum(lengths), int(kv_bytes)


def compare(model: Any, tok: Any, prompts: list[list[int]], lengths: list[int], repeats: int, tag: str) -> dict[str, float]:
    """Interleaved engine / HF runs (after one short warm-up each); medians."""
    run_engine(model, tok, prompts[:4], [8] * 4, seed=99)
    run_hf(model, tok, prompts[:4], [8] * 4, seed=99)
    eng_t: list[float] = []
    hf_t: list[float] = []
    eng_mem: list[int] = []
    hf_mem: list[int] = []
    useful = sum(lengths)
    eng_kv = hf_kv = 0
    for r in range(repeats):
        runs: list[tuple[str, Callable[..., tuple[float, int, int]]]] = [("engine", run_engine), ("hf", run_hf)]
        if r % 2:
            runs.reverse()
        for name, fn in runs:
            with PeakRSS() as mem:
                dt, n, kv = fn(model, tok, prompts, lengths, seed=r)
            assert n == useful
            if name == "engine":
                eng_t.append(dt)
                eng_mem.append(mem.peak_delta)
                eng_kv = kv
            else:
                hf_t.append(dt)
                hf_mem.append(mem.peak_delta)
                hf_kv = kv
            print(f"[{tag}] run {r} {name:6s}: {dt:6.2f} s  {useful / dt:8.1f} useful tok/s  "
                  f"peak RSS +{mem.peak_delta / 2**20:.1f} MB", flush=True)
    eng_tps = useful / statistics.median(eng_t)
    hf_tps = useful / statistics.median(hf_t)
    return {
        "speedup_vs_hf_generate": eng_tps / hf_tps,
        "engine_tokens_per_s": eng_tps,
        "hf_tokens_per_s": hf_tps,
        "engine_inproc_peak_rss_mb": max(eng_mem) / 2**20,
        "hf_inproc_peak_rss_mb": max(hf_mem) / 2**20,
        "engine_kv_cache_mb": eng_kv / 2**20,
        "hf_kv_cache_mb": hf_kv / 2**20,
        "engine_seconds_median": statistics.median(eng_t),
        "hf_seconds_median": statistics.median(hf_t),
    }


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
    fn = run_engine if args.memory_child == "engine" else run_hf
    with PeakRSS() as mem:
        fn(model, tok, prompts, lengths, seed=0)
    print(json.dumps({"peak_rss_mb": mem.peak_delta / 2**20}))


def measure_memory(args: argparse.Namespace, tok_dir: str, qat: bool) -> dict[str, float]:
    """Peak RSS growth of one engine run and one HF run, each in its own subprocess."""
    import subprocess
    import sys

    out: dict[str, float] = {}
    for side in ("engine", "hf"):
        cmd = [sys.executable, __file__, "--memory-child", side, "--tokenizer-dir", tok_dir, "--threads", str(args.threads),
               "--prompts", str(args.prompts), "--median-len", str(args.median_len), "--sigma", str(args.sigma),
               "--max-len", str(args.max_len), "--seed", str(args.seed)] + (["--qat"] if qat else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[f"{side}_peak_rss_mb"] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    print(f"peak RSS growth during one run ({'QAT on' if qat else 'QAT off'}, fresh process each): "
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
    if args.repeats < 1 or args.prompts < 1 or args.max_len < 4:
        raise ValueError("--repeats and --prompts must be >= 1 and --max-len >= 4")
    torch.set_num_threads(args.threads)

    tok_dir = tempfile.mkdtemp(prefix="k3post-bench-tok-")
    try:
        _main(args, tok_dir)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)


def _main(args: argparse.Namespace, tok_dir: str) -> None:
    tok = train_tokenizer(default_corpus(), vocab_size=512, out_dir=tok_dir)
    model, prompts, lengths = _setup(args, tok)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; output lengths "
          f"sum {sum(lengths)}, median {statistics.median(lengths)}, max {max(lengths)}: {sorted(lengths)}")

    result: dict[str, float] = {}
    result.update(compare(model, tok, prompts, lengths, args.repeats, "QAT off"))
    result.update(measure_memory(args, tok_dir, qat=False))
    if not args.no_qat:
        apply_qat(model, QATConfig())
        qat = compare(model, tok, prompts, lengths, args.repeats, "QAT on")
        remove_qat(model)
        qat.update(measure_memory(args, tok_dir, qat=True))
        result.update({f"{k}_qat": v for k, v in qat.items()})
    result.update(
        useful_tokens=float(sum(lengths)),
        max_length=float(max(lengths)),
        threads=float(torch.get_num_threads()),
        load_average_1min=os.getloadavg()[0],
        process_max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    for k in ("speedup_vs_hf_generate", "speedup_vs_hf_generate_qat"):
        if k in result:
            print(f"{k}: {result[k]:.2f}x (target >= 3)")
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
