"""bench/row_invariance.py probes what it says: the tiled linear and the product-and-sum linear compute F.linear's
product (to fp32 rounding: other summation orders), and the probe reports every op it names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.bench_module import load_bench


def test_the_probed_linears_compute_the_same_product_and_every_op_is_reported():
    bench = load_bench("row_invariance")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 128, generator=g), torch.randn(64, 128, generator=g)
    ref = F.linear(x, w)
    # |x·w| sums 128 products of N(0,1) pairs: the fp32 rounding of another order stays far below 1e-4
    assert torch.allclose(bench.tiled_linear(x, w, 16), ref, atol=1e-4)
    assert torch.allclose(bench.mul_sum(x, w, chunk=8), ref, atol=1e-4)
    assert bench.tiled_linear(x, w, 16).shape == (37, 64)
    res = bench.probe([1, 3, 17], tile=16, subsets=3)
    assert set(res) == {"linear", "linear_tiled", "mul_sum", "rms_norm", "softmax", "log_softmax", "pv_sum"}
    assert all(isinstance(v, bool) for v in res.values())
