"""Probe: which torch ops give a row the same bits whatever rows share its call (what an exact mode needs, issue 35
§exactprobe in docs/decisions.md).

For each op, a reference over 2,048 rows is compared bit for bit with calls over the first m rows (m in
``--rows``) and, for the tiled linear, over random subsets of rows in any order (other neighbours, other
positions in a tile). Shapes are the demo model's: hidden 128, head dim 32, vocabulary 1,024. Ops:

    linear            F.linear(X, W) in one call
    linear_tiled      F.linear on fixed tiles of ``--tile`` rows (the last one padded with zeros)
    mul_sum           (X[:, None, :] * W).sum(-1), a linear without a GEMM kernel
    rms_norm          F.rms_norm over the hidden dim
    softmax / log_softmax   over the vocabulary
    pv_sum            attention's p·V as (p[..., None] * v).sum(-2) over 512 keys

Timing (``linear_tiled`` and ``mul_sum`` against one ``F.linear`` call over the 2,048 rows, 10 repeats in this
process) is printed with each. Run: ``python bench/row_invariance.py [--threads 1] [--tile 16]``; the last line
is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_state  # noqa: E402


def tiled_linear(x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
    """F.linear over fixed tiles of ``tile`` rows (the last padded with zeros)."""
    n = x.shape[0]
    pad = (-n) % tile
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([F.linear(xp[i:i + tile], w) for i in range(0, xp.shape[0], tile)])[:n]


def mul_sum(x: torch.Tensor, w: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    return torch.cat([(x[i:i + chunk, None, :] * w[None]).sum(-1) for i in range(0, x.shape[0], chunk)])


def probe(rows: list[int], tile: int, subsets: int = 50) -> dict[str, bool]:
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(2048, 128, generator=g), torch.randn(1024, 128, generator=g)
    norm_w, S = torch.randn(128, generator=g), torch.randn(2048, 1024, generator=g)
    P = torch.softmax(torch.randn(64, 4, 512, generator=g), -1)
    Vv = torch.randn(64, 4, 512, 32, generator=g)
    ops = {
        "linear": (lambda m: F.linear(X[:m], W)),
        "linear_tiled": (lambda m: tiled_linear(X[:m], W, tile)),
        "mul_sum": (lambda m: mul_sum(X[:m], W)),
        "rms_norm": (lambda m: F.rms_norm(X[:m], (128,), norm_w, 1e-6)),
        "softmax": (lambda m: torch.softmax(S[:m], -1)),
        "log_softmax": (lambda m: torch.log_softmax(S[:m], -1)),
        "pv_sum": (lambda m: (P[:m, ..., None] * Vv[:m]).sum(-2)),
    }
    full = {"pv_sum": 64}
    out = {}
    for name, fn in ops.items():
        ref = fn(full.get(name, 2048))
        out[name] = all(torch.equal(fn(m), ref[:m]) for m in rows if m <= full.get(name, 2048))
    ref = tiled_linear(X, W, tile)
    for _ in range(subsets):  # other neighbours, other positions in a tile
        idx = torch.randperm(2048, generator=g)[: int(torch.randint(1, 40, (1,), generator=g))]
        out["linear_tiled"] &= torch.equal(tiled_linear(X[idx], W, tile), ref[idx])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 7, 8, 17, 33, 100, 1000])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = probe(args.rows, args.tile)
    X, W = torch.randn(2048, 128), torch.randn(1024, 128)
    times = {}
    for name, fn in (("linear", lambda: F.linear(X, W)), ("linear_tiled", lambda: tiled_linear(X, W, args.tile)),
                     ("mul_sum", lambda: mul_sum(X, W))):
        fn()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        times[name] = (time.perf_counter() - t0) / 10
    for name, ok in res.items():
        cost = f"  {times[name] / times['linear']:.2f}x one F.linear call" if name in times and name != "linear" else ""
        print(f"{name:12s} row-invariant: {ok}{cost}")
    print(json.dumps({"machine": machine_state(), "threads": args.threads, "tile": args.tile, "invariant": res,
                      "cost_vs_linear": {k: v / times["linear"] for k, v in times.items()}}))


if __name__ == "__main__":
    main()
