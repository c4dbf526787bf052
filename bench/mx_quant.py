"""Benchmark: MX quantize throughput and the step-time cost of QAT on CPU.

What each number measures
  * ``fp4_quant_gbps`` / ``fp8_quant_gbps`` (and ``*_fake_quant_gbps``): ``quantize_mx``
    (codes + E8M0 scales) and ``fake_quant_mx`` on a 4096 x 4096 fp32 tensor, GB/s of fp32
    input at the median time of ``--repeats`` interleaved runs (``*_gbps_min`` / ``_max``:
    from the slowest / fastest run), with the current torch threads and again with one
    thread (``*_1thread``; a descheduled OpenMP thread makes multi-threaded runs noisy on a
    shared machine).
  * forward + backward step time of a tiny Qwen3-MoE (hidden 128, 4 layers, 4 heads / 2 kv
    heads, head_dim 32, 8 experts top-2, moe_intermediate 64, vocab 512) on 16 x 256 tokens,
    three arms in one process on one model, one torch thread by default (``--step-threads``; with
    2 threads on a loaded 2-core machine a step swung from 0.3 to 8 s, a descheduled OpenMP thread
    stalling the rest), interleaved with the order rotated every round (``bench/common.py``):
      - ``qat``: ``apply_qat(QATConfig())``, the grouped expert kernel of
        ``k3post.quant.qat`` with MXFP4 weights and MXFP8 expert-GEMM inputs;
      - ``grouped_identity``: the SAME grouped kernel (``apply_qat``), with
        ``qat.qat_fake_quant`` replaced by the identity for the duration of the step
        (``identity_quantization``): same sort, grouped GEMMs, gather / scatter, no rounding;
      - ``stock``: QAT removed, transformers' own experts forward
        (``config._experts_implementation``, ``grouped_mm`` in transformers 5).
  * ``qat_step_overhead`` (HEADLINE) = median step(qat) / median step(grouped_identity):
    what the MX fake quantization itself costs (weights once per call, activations per
    GEMM input, the straight-through autograd nodes), target <= 1.5 (``qat_target_met``).
  * ``grouped_vs_stock_experts`` = median step(grouped_identity) / median step(stock): the
    k3post grouped kernel against transformers' experts with no quantization on either
    side (the kernel's own cost, not QAT's).
  * ``qat_vs_stock_experts`` = median step(qat) / median step(stock): the old headline
    (both effects together), kept for comparison with earlier runs.
  Each ratio comes with ``_min`` / ``_max`` over paired repeats (repeat i of both arms, run
  back to back) and ``_n``.

Excluded: the optimizer step (only forward + backward + zero_grad is timed), data loading,
and every one-off (warm-up steps of each arm are untimed). The identity arm keeps the
Python-level calls of the QAT forward (four calls of a function returning its argument per
expert block), so the headline understates the rounding cost by that overhead, if anything.

Caveats: a tiny model on a shared 2-core CPU; the expert GEMMs here are small, so fixed
per-op overheads weigh more than on a real model. ``machine`` (``bench/common.py``
``machine_state()``) records the load average, CPU, threads (``--threads``; the step arms' count
is ``step_threads``) and kernel capability at the end of the run; compare runs on one machine only.

Prints human-readable lines, then one final JSON line.

Usage: python bench/mx_quant.py [--repeats 7] [--steps 6] [--threads N] [--step-threads 1]

Shape legend: B batch, T sequence length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine_state, ratio_summary, summary  # noqa: E402

import k3post.quant.qat as qat  # noqa: E402
from k3post.quant.mx import fake_quant_mx, quantize_mx  # noqa: E402
from k3post.quant.qat import QATConfig, apply_qat, remove_qat  # noqa: E402

QAT_TARGET = 1.5


def _identity_fake_quant(x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1) -> torch.Tensor:
    """``qat_fake_quant`` with the rounding removed: returns x itself (no copy, no autograd node)."""
    return x


@contextlib.contextmanager
def identity_quantization() -> Iterator[None]:
    """Within the block, every QAT forward of ``k3post.quant.qat`` (which looks ``qat_fake_quant``
    up in its module at call time) runs with the identity instead of MX fake quantization; the
    library function is put back on exit. The same mechanism as tests/test_qat.py's identity
    check of the grouped forward against transformers' own."""
    saved = qat.qat_fake_quant
    qat.qat_fake_quant = _identity_fake_quant
    try:
        yield
    finally:
        qat.qat_fake_quant = saved


def set_experts(model: torch.nn.Module, arm: str) -> None:
    """Put ``model`` in one arm's state: "stock" (QAT removed) or "qat" / "grouped_identity"
    (``apply_qat``; the identity arm swaps the quantizer at call time, see ``run_arm``)."""
    want_qat = arm != "stock"
    has_qat = any(hasattr(m, "_k3post_qat") for m in model.modules())
    if has_qat and not want_qat:
        remove_qat(model)
    elif want_qat and not has_qat:
        apply_qat(model, QATConfig())


def run_arm(model: torch.nn.Module, arm: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the model's experts in ``arm``'s state."""
    set_experts(model, arm)
    with identity_quantization() if arm == "grouped_identity" else contextlib.nullcontext():
        return fn()


def tiny_moe(seed: int = 0, **overrides: Any) -> transformers.Qwen3MoeForCausalLM:
    """The bench's tiny Qwen3-MoE (module doc); ``overrides`` change config fields (tests)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs))


def _discard(_: object) -> None:
    return None


def bench_quant(repeats: int, suffix: str = "") -> dict[str, float]:
    """GB/s of fp32 input for quantize_mx and fake_quant_mx on a 4096x4096 tensor, the four
    (format, function) arms interleaved; median and min-max over ``repeats``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=gen)
    nbytes = x.numel() * x.element_size()
    arms: dict[str, Callable[[], None]] = {}
    for fmt, key in (("fp4_e2m1", "fp4"), ("fp8_e4m3", "fp8")):
        for name, fn in (("quant", quantize_mx), ("fake_quant", fake_quant_mx)):
            arms[f"{key}_{name}"] = lambda fn=fn, fmt=fmt: _discard(fn(x, fmt))  # None: timed by interleaved()
    times = interleaved(arms, repeats=repeats, warmup=1)
    out: dict[str, float] = {}
    for name, ts in times.items():
        s = summary(name, ts)
        gbps = nbytes / s[f"{name}_median"] / 1e9
        out[f"{name}_gbps{suffix}"] = gbps
        out[f"{name}_gbps{suffix}_min"] = nbytes / s[f"{name}_max"] / 1e9
        out[f"{name}_gbps{suffix}_max"] = nbytes / s[f"{name}_min"] / 1e9
        print(f"{name} ({torch.get_num_threads()} threads): {gbps:.2f} GB/s (median {s[f'{name}_median'] * 1e3:.1f} ms, "
              f"min-max {s[f'{name}_min'] * 1e3:.1f}-{s[f'{name}_max'] * 1e3:.1f} ms, n={len(ts)})")
    return out


def bench_qat(steps: int, *, batch: int = 16, seq: int = 256, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Forward + backward step times of the three arms (module doc), interleaved; ratios of medians."""
    model = (model if model is not None else tiny_moe()).train()
    ids_BT = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids_BT, labels=ids_BT).loss.backward()
        return time.perf_counter() - t0

    arms = {arm: (lambda arm=arm: run_arm(model, arm, step)) for arm in ("stock", "grouped_identity", "qat")}
    times = interleaved(arms, repeats=steps, warmup=1)
    set_experts(model, "stock")
    out: dict[str, Any] = {}
    for arm, ts in times.items():
        out.update(summary(f"step_ms_{arm}", ts, scale=1e3))
        print(f"tiny MoE fwd+bwd {batch}x{seq} tokens, {arm:16s}: median {out[f'step_ms_{arm}_median']:.1f} ms "
              f"(min-max {out[f'step_ms_{arm}_min']:.1f}-{out[f'step_ms_{arm}_max']:.1f}, n={len(ts)})")
    out.update(ratio_summary("qat_step_overhead", times["qat"], times["grouped_identity"]))
    out.update(ratio_summary("grouped_vs_stock_experts", times["grouped_identity"], times["stock"]))
    out.update(ratio_summary("qat_vs_stock_experts", times["qat"], times["stock"]))
    out["stock_experts_implementation"] = str(model.config._experts_implementation)
    out["qat_target"] = QAT_TARGET
    out["qat_target_met"] = bool(out["qat_step_overhead"] <= QAT_TARGET)
    for key, what in (("qat_step_overhead", "QAT vs the same grouped kernel, identity quantizer (HEADLINE)"),
                      ("grouped_vs_stock_experts",
                       f"grouped kernel vs transformers' {out['stock_experts_implementation']} experts"),
                      ("qat_vs_stock_experts", "QAT vs transformers' experts (old headline)")):
        print(f"{key} = {out[key]:.3f} (paired min-max {out[key + '_min']:.3f}-{out[key + '_max']:.3f}): {what}")
    print(f"target qat_step_overhead <= {QAT_TARGET}: {'met' if out['qat_target_met'] else 'NOT met'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per quantize measurement (>= 3)")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per QAT arm (>= 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--step-threads", type=int, default=1,
                        help="torch threads for the QAT step arms (0: same as --threads; 1 is stable on a shared machine)")
    args = parser.parse_args()
    if args.repeats < 3 or args.steps < 3:
        raise ValueError(f"--repeats and --steps must be >= 3, got {args.repeats} and {args.steps}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, threads {threads}, machine at start {machine_state()['loadavg_1m_5m_15m']}")
    quant = bench_quant(args.repeats)
    if threads > 1:
        torch.set_num_threads(1)
        quant.update(bench_quant(args.repeats, suffix="_1thread"))
        torch.set_num_threads(threads)
    if args.step_threads > 0:
        torch.set_num_threads(args.step_threads)
    result: dict[str, Any] = bench_qat(args.steps)  # the step arms and their ratios (the headline) first
    result["step_threads"] = torch.get_num_threads()
    torch.set_num_threads(threads)
    result.update(quant)
    result["wall_s"] = time.perf_counter() - t_start
    result["machine"] = machine_state()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
