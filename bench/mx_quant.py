"""Benchmark: MX quantize throughput and QAT step overhead on CPU.

Measures
  * ``quantize_mx`` (codes + E8M0 scales) and ``fake_quant_mx`` throughput on a
    4096 x 4096 fp32 tensor, in GB/s of fp32 input (median of ``--repeats`` runs),
    for fp4_e2m1 and fp8_e4m3;
  * forward + backward step time of a tiny Qwen3-MoE (hidden 128, 4 layers, 4 heads /
    2 kv heads, head_dim 32, 8 experts top-2, moe_intermediate 64, vocab 512) on
    16 x 256 tokens, QAT off vs on in the same process (interleaved, median of steps);
    ``qat_step_overhead`` = median step(QAT on) / median step(QAT off), target <= 1.5.

Prints human-readable lines, then one final JSON line with keys ``fp4_quant_gbps``,
``fp8_quant_gbps``, ``qat_step_overhead`` (plus fake-quant and single-thread
throughputs, the raw step timings and the 1-minute load average, since timings on a
shared machine depend on what else runs).

Usage: python bench/mx_quant.py [--repeats 7] [--steps 6] [--threads N]

Shape legend: B batch, T sequence length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from k3post.quant.mx import fake_quant_mx, quantize_mx
from k3post.quant.qat import QATConfig, apply_qat, remove_qat


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_quant(repeats: int, suffix: str = "") -> dict[str, float]:
    """GB/s of fp32 input for quantize_mx and fake_quant_mx on a 4096x4096 tensor
    (median of ``repeats`` runs) with the current torch thread count."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=gen)
    nbytes = x.numel() * x.element_size()
    out: dict[str, float] = {}
    for fmt, key in (("fp4_e2m1", "fp4"), ("fp8_e4m3", "fp8")):
        t_q = _median_seconds(lambda: quantize_mx(x, fmt), repeats)
        t_f = _median_seconds(lambda: fake_quant_mx(x, fmt), repeats)
        out[f"{key}_quant_gbps{suffix}"] = nbytes / t_q / 1e9
        out[f"{key}_fake_quant_gbps{suffix}"] = nbytes / t_f / 1e9
        print(f"{fmt} ({torch.get_num_threads()} threads): quantize_mx {nbytes / t_q / 1e9:.2f} GB/s "
              f"({t_q * 1e3:.1f} ms), fake_quant_mx {nbytes / t_f / 1e9:.2f} GB/s ({t_f * 1e3:.1f} ms)")
    return out


def bench_qat(steps: int) -> dict[str, float]:
    """Median forward+backward step time of the tiny MoE, QAT off vs on."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).train()
    ids_BT = torch.randint(0, cfg.vocab_size, (16, 256), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids_BT, labels=ids_BT).loss
        loss.backward()

    t_off: list[float] = []
    t_on: list[float] = []
    step()  # warm-up, QAT off
    apply_qat(model, QATConfig())
    step()  # warm-up, QAT on
    remove_qat(model)
    for _ in range(steps):  # interleave so machine noise hits both arms alike
        t_off.append(_median_seconds(step, 1, warmup=0))
        apply_qat(model, QATConfig())
        t_on.append(_median_seconds(step, 1, warmup=0))
        remove_qat(model)
    off, on = statistics.median(t_off), statistics.median(t_on)
    print(f"tiny MoE fwd+bwd, 16x256 tokens ({model.config._experts_implementation} experts when QAT off): "
          f"QAT off {off * 1e3:.1f} ms, QAT on {on * 1e3:.1f} ms, ratio {on / off:.2f}")
    return {"step_ms_qat_off": off * 1e3, "step_ms_qat_on": on * 1e3, "qat_step_overhead": on / off}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per quantize measurement")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per QAT arm")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, threads {threads}, load average {os.getloadavg()[0]:.2f}")
    result = bench_quant(args.repeats)
    if threads > 1:
        # Single-threaded too: on a shared machine, OpenMP barriers with a descheduled
        # thread make multi-threaded medians noisy; one thread is stable.
        torch.set_num_threads(1)
        result.update(bench_quant(args.repeats, suffix="_1thread"))
        torch.set_num_threads(threads)
    result.update(bench_qat(args.steps))
    result["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
