"""The operators of ``coding.kernel``: plain-Python references, shipped expert C kernels, inputs, costs.

Each `KernelOp` carries

* ``reference``: the plain-Python operator the prompt shows (flat ``array.array`` inputs, integer
  dims, a list out); its IEEE semantics (a row with a NaN is all NaN, ``x > m`` maxima, fixed
  summation order) are what every implementation must reproduce,
* ``expert``: the C implementation we ship (the parity point of the speed score, 0.5); ``{T}`` is
  the storage type (``double`` / ``float``), accumulation is in double,
* ``inputs(dims)`` / ``outputs(dims)`` (from ``out_expr``): flat lengths of the arguments and the result,
* ``flops(dims)``: floating-point operations for the roofline (a transcendental counts as 1, so the
  roofline is optimistic),
* ``sizes``: dims per difficulty; ``odd``: a second shape with odd extents for the hidden tail check.

Inputs are flat row-major buffers; ``dims`` are passed after them as plain ints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["KernelOp", "OPS", "CALIBRATION_C"]


@dataclass(frozen=True)
class KernelOp:
    name: str  # also the function name
    summary: str
    args: tuple[str, ...]  # input buffer names
    dims: tuple[str, ...]  # integer dimension names, in call order
    inputs: Callable[[dict[str, int]], tuple[int, ...]]
    out_expr: str  # Python expression of the output length in the dims
    flops: Callable[[dict[str, int]], float]
    sizes: tuple[dict[str, int], ...]  # difficulty 1, 2 (float64) ; 3 reuses 2 in float32
    odd: dict[str, int]
    reference: str
    expert: str
    scale: float = 1.0  # magnitude of random inputs

    def outputs(self, dims: dict[str, int]) -> int:
        """Length of the flat result."""
        return int(eval(self.out_expr, {"__builtins__": {}}, dict(dims)))  # noqa: S307 - our own constant


_SOFTMAX_REF = '''import math


def softmax(x, rows, cols):
    """Row-wise softmax of a rows x cols matrix (max-subtracted)."""
    out = [0.0] * (rows * cols)
    for r in range(rows):
        base = r * cols
        m = x[base]
        for j in range(base, base + cols):
            if x[j] > m:
                m = x[j]
        s = 0.0
        for j in range(base, base + cols):
            e = math.exp(x[j] - m)
            out[j] = e
            s += e
        for j in range(base, base + cols):
            out[j] = out[j] / s
    return out
'''

_SOFTMAX_C = '''#include <math.h>
void softmax(const {T} *restrict x, {T} *restrict out, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const {T} *xr = x + (long)r * cols; {T} *o = out + (long)r * cols;
        double m = xr[0];
        for (int j = 0; j < cols; j++) if (xr[j] > m) m = xr[j];
        double s = 0.0;
        for (int j = 0; j < cols; j++) { double e = exp((double)xr[j] - m); o[j] = ({T})e; s += e; }
        for (int j = 0; j < cols; j++) o[j] = ({T})(o[j] / s);
    }
}
'''

_LAYERNORM_REF = '''import math


def layernorm(x, gamma, beta, rows, cols):
    """Row-wise layer norm (biased variance, eps 1e-5) with a per-column scale and shift."""
    out = [0.0] * (rows * cols)
    for r in range(rows):
        base = r * cols
        mean = 0.0
        for j in range(base, base + cols):
            mean += x[j]
        mean /= cols
        var = 0.0
        for j in range(base, base + cols):
            d = x[j] - mean
            var += d * d
        var /= cols
        inv = 1.0 / math.sqrt(var + 1e-5)
        for j in range(base, base + cols):
            out[j] = (x[j] - mean) * inv * gamma[j - base] + beta[j - base]
    return out
'''

_LAYERNORM_C = '''#include <math.h>
void layernorm(const {T} *restrict x, const {T} *restrict g, const {T} *restrict b, {T} *restrict out,
               int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const {T} *xr = x + (long)r * cols; {T} *o = out + (long)r * cols;
        double mean = 0.0;
        for (int j = 0; j < cols; j++) mean += xr[j];
        mean /= cols;
        double var = 0.0;
        for (int j = 0; j < cols; j++) { double d = xr[j] - mean; var += d * d; }
        var /= cols;
        double inv = 1.0 / sqrt(var + 1e-5);
        for (int j = 0; j < cols; j++) o[j] = ({T})((xr[j] - mean) * inv * g[j] + b[j]);
    }
}
'''

_MATMUL_REF = '''def matmul_relu(a, w, b, m, k, n):
    """relu(a @ w + b): a is m x k, w is k x n, b has n entries; relu(NaN) is 0."""
    out = [0.0] * (m * n)
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for p in range(k):
                acc += a[i * k + p] * w[p * n + j]
            v = acc + b[j]
            out[i * n + j] = v if v > 0 else 0.0
    return out
'''

_MATMUL_C = '''void matmul_relu(const {T} *restrict a, const {T} *restrict w, const {T} *restrict b, {T} *restrict out,
                 int m, int k, int n) {
    double acc[n];
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) acc[j] = 0.0;
        for (int p = 0; p < k; p++) {
            double av = a[(long)i * k + p]; const {T} *wr = w + (long)p * n;
            for (int j = 0; j < n; j++) acc[j] += av * wr[j];
        }
        for (int j = 0; j < n; j++) { double v = acc[j] + b[j]; out[(long)i * n + j] = ({T})(v > 0 ? v : 0.0); }
    }
}
'''

_SUMSQ_REF = '''def row_sumsq(x, rows, cols):
    """Sum of squares of each row of a rows x cols matrix."""
    out = [0.0] * rows
    for r in range(rows):
        s = 0.0
        for j in range(r * cols, (r + 1) * cols):
            s += x[j] * x[j]
        out[r] = s
    return out
'''

_SUMSQ_C = '''void row_sumsq(const {T} *restrict x, {T} *restrict out, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const {T} *xr = x + (long)r * cols;
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0; int j = 0;
        for (; j + 4 <= cols; j += 4) {
            s0 += (double)xr[j] * xr[j]; s1 += (double)xr[j + 1] * xr[j + 1];
            s2 += (double)xr[j + 2] * xr[j + 2]; s3 += (double)xr[j + 3] * xr[j + 3];
        }
        for (; j < cols; j++) s0 += (double)xr[j] * xr[j];
        out[r] = ({T})((s0 + s1) + (s2 + s3));
    }
}
'''

_STENCIL_REF = '''def stencil5(x, h, w):
    """One Jacobi step of the 5-point average on an h x w grid; the border is copied."""
    out = list(x)
    for i in range(1, h - 1):
        for j in range(1, w - 1):
            c = i * w + j
            out[c] = (x[c] + x[c - w] + x[c + w] + x[c - 1] + x[c + 1]) * 0.2
    return out
'''

_STENCIL_C = '''void stencil5(const {T} *restrict x, {T} *restrict out, int h, int w) {
    for (long c = 0; c < (long)h * w; c++) out[c] = x[c];
    for (int i = 1; i < h - 1; i++) {
        const {T} *r = x + (long)i * w; {T} *o = out + (long)i * w;
        for (int j = 1; j < w - 1; j++)
            o[j] = ({T})(((double)r[j] + r[j - w] + r[j + w] + r[j - 1] + r[j + 1]) * 0.2);
    }
}
'''

OPS: dict[str, KernelOp] = {
    op.name: op
    for op in (
        KernelOp("softmax", "row-wise softmax", ("x",), ("rows", "cols"),
                 lambda d: (d["rows"] * d["cols"],), "rows * cols",
                 lambda d: 5.0 * d["rows"] * d["cols"],
                 ({"rows": 32, "cols": 128}, {"rows": 64, "cols": 256}), {"rows": 5, "cols": 37},
                 _SOFTMAX_REF, _SOFTMAX_C, scale=4.0),
        KernelOp("layernorm", "row-wise layer norm with scale and shift", ("x", "gamma", "beta"), ("rows", "cols"),
                 lambda d: (d["rows"] * d["cols"], d["cols"], d["cols"]), "rows * cols",
                 lambda d: 8.0 * d["rows"] * d["cols"],
                 ({"rows": 32, "cols": 128}, {"rows": 64, "cols": 256}), {"rows": 5, "cols": 37},
                 _LAYERNORM_REF, _LAYERNORM_C),
        KernelOp("matmul_relu", "fused matmul + bias + ReLU", ("a", "w", "b"), ("m", "k", "n"),
                 lambda d: (d["m"] * d["k"], d["k"] * d["n"], d["n"]), "m * n",
                 lambda d: 2.0 * d["m"] * d["k"] * d["n"] + 2.0 * d["m"] * d["n"],
                 ({"m": 16, "k": 32, "n": 32}, {"m": 32, "k": 48, "n": 64}), {"m": 3, "k": 7, "n": 5},
                 _MATMUL_REF, _MATMUL_C),
        KernelOp("row_sumsq", "row-wise sum of squares (a reduction)", ("x",), ("rows", "cols"),
                 lambda d: (d["rows"] * d["cols"],), "rows",
                 lambda d: 2.0 * d["rows"] * d["cols"],
                 ({"rows": 32, "cols": 128}, {"rows": 64, "cols": 256}), {"rows": 5, "cols": 37},
                 _SUMSQ_REF, _SUMSQ_C),
        KernelOp("stencil5", "5-point Jacobi stencil step", ("x",), ("h", "w"),
                 lambda d: (d["h"] * d["w"],), "h * w",
                 lambda d: 5.0 * d["h"] * d["w"],
                 ({"h": 64, "w": 64}, {"h": 128, "w": 128}), {"h": 5, "w": 9},
                 _STENCIL_REF, _STENCIL_C),
    )
}

CALIBRATION_C = '''/* roofline calibration: a streaming copy (bytes/s) and independent multiply-adds (flop/s) */
void k3_copy(const double *restrict src, double *restrict dst, long n) { for (long i = 0; i < n; i++) dst[i] = src[i]; }
double k3_fma(long iters) {
    double a0 = 1, a1 = 1.1, a2 = 1.2, a3 = 1.3, a4 = 1.4, a5 = 1.5, a6 = 1.6, a7 = 1.7;
    double s[8][4] = {{0}};
    for (long i = 0; i < iters; i++)
        for (int v = 0; v < 4; v++) {
            s[0][v] = s[0][v] * 0.999 + a0; s[1][v] = s[1][v] * 0.999 + a1; s[2][v] = s[2][v] * 0.999 + a2;
            s[3][v] = s[3][v] * 0.999 + a3; s[4][v] = s[4][v] * 0.999 + a4; s[5][v] = s[5][v] * 0.999 + a5;
            s[6][v] = s[6][v] * 0.999 + a6; s[7][v] = s[7][v] * 0.999 + a7;
        }
    double t = 0; for (int u = 0; u < 8; u++) for (int v = 0; v < 4; v++) t += s[u][v];
    return t;  /* 64 flops per iteration */
}
'''
