"""OCP Microscaling (MX v1.0) quantizer: MXFP4 (E2M1) and MXFP8 (E4M3 / E5M2).

Pure tensor functions: tensors in, tensors out. Used by QAT (``k3post.quant.qat``),
by the rollout engine (through the same ``fake_quant_mx``) and by export.

Shape legend (suffixes on tensor names):
    N   number of MX blocks (product of all dims after reshaping to blocks)
    B   block size (32 by default), the block runs along ``axis``
    S   the input shape ``x.shape``
    G   ``x.shape`` with ``axis`` divided by ``block_size`` (one entry per block)
    P   ``codes.shape`` with the last axis halved (two FP4 codes per byte)
    L   lookup-table entries (16 E2M1 codes, 256 E8M0 bytes)

Source: "OCP Microscaling Formats (MX) Specification v1.0" (Open Compute Project,
2023): the E8M0 scale and element formats, and the conversion of a vector of
high-precision values to MX:

    X        = 2^shared,   shared = floor(log2(max_i |v_i|)) - emax_elem
    P_i      = quantize_elem(v_i / X)   (round to nearest, ties to even, saturate)
    v_i_hat  = X * P_i

with emax_elem = 2 (E2M1), 8 (E4M3), 15 (E5M2) and saturation values 6, 448, 57344.

Decisions:

* Exponents are exact: floor(log2(amax)) is read from the fp32 exponent bits of amax,
  which is exactly ``torch.frexp(amax).exponent - 1`` for normal numbers; for fp32
  subnormals and zero the result is <= -127 - emax and clamps to the smallest scale,
  so both give the same byte. No float ``log2`` is used.
* The shared exponent is clamped to the E8M0 range [-127, 127]; byte = shared + 127.
  An all-zero block (and any block whose amax is below 2^(-127 + emax)) gets byte 0,
  i.e. scale 2^-127.
* NaN / Inf: a block holding any NaN or +-Inf gets scale byte 0xFF (NaN); its element
  codes are set to 0 and every element of that block dequantizes to NaN (in OCP MX a
  NaN scale makes the whole block NaN). Other blocks are unaffected.
* Padding: none. The length of ``axis`` must be a multiple of ``block_size``; otherwise
  a ``ValueError`` is raised (pad the tensor yourself if you want the OCP tail-block
  convention; for the expert weights k3post quantizes, every reduction dim is a
  multiple of 32).
* Element codes. FP4: ``uint8`` holding one 4-bit code per element (bit 3 = sign,
  bits 0-2 = E2M1 magnitude code; 0..7 <-> 0, 0.5, 1, 1.5, 2, 3, 4, 6); pack with
  ``pack_fp4``. FP8: the torch float8 dtypes ``torch.float8_e4m3fn`` /
  ``torch.float8_e5m2``; ``codes.view(torch.uint8)`` is the OCP bit pattern and
  ``dequantize_mx`` accepts either.
* Rounding. ``quantize_mx`` for FP8 uses torch's fp32 -> float8 cast after a
  saturating clamp (round to nearest even). Everything else (FP4 codes, all fake
  quantization) uses exact fp32 arithmetic: with c = 2^(max(e(a), emin) - mbits + 23),
  (a + c) - c rounds a to a multiple of the grid step with the FPU's ties-to-even,
  which is the element format's round-to-nearest-even. tests/test_mx.py checks the two
  agree bit for bit (fake_quant == dequantize(quantize)).
* Inputs: float32, bfloat16 or float16; all math runs in float32 (exact for these).
  ``fake_quant_mx`` returns x's dtype; dequantized values that are fp16/bf16-subnormal
  round in that final cast. Under ``torch.set_flush_denormal(True)`` the CPU treats
  fp32 subnormals (inputs below 2^-126 and the 2^-127 scale) as zero, so such tiny
  values quantize / dequantize to 0; nothing else changes.
* Speed: vectorised, in-place, processed in slabs of ``_CHUNK_ELEMS`` elements so the
  fp32 temporaries stay in cache and are not re-faulted from the OS on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3post.constants import MX_FORMAT_NAMES

__all__ = [
    "MX_FORMATS",
    "MXFormat",
    "E2M1_VALUES",
    "quantize_mx",
    "dequantize_mx",
    "fake_quant_mx",
    "fake_quant_fp8_lastdim",
    "pack_fp4",
    "unpack_fp4",
]


@dataclass(frozen=True)
class MXFormat:
    """One MX element format.

    Fields:
        name: "fp4_e2m1", "fp8_e4m3" or "fp8_e5m2".
        emax: exponent of the largest normal element value (2, 8, 15).
        emin: exponent of the smallest normal element value (0, -6, -14); below it the
            element grid is uniform with step 2^(emin - mbits) (subnormals).
        mbits: explicit mantissa bits (1, 3, 2).
        max_value: largest finite element magnitude (6, 448, 57344); saturation bound.
        torch_dtype: torch dtype of the element codes (``torch.uint8`` for FP4).
    """

    name: str
    emax: int
    emin: int
    mbits: int
    max_value: float
    torch_dtype: torch.dtype


MX_FORMATS: dict[str, MXFormat] = {
    "fp4_e2m1": MXFormat("fp4_e2m1", 2, 0, 1, 6.0, torch.uint8),
    "fp8_e4m3": MXFormat("fp8_e4m3", 8, -6, 3, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": MXFormat("fp8_e5m2", 15, -14, 2, 57344.0, torch.float8_e5m2),
}
assert tuple(MX_FORMATS) == MX_FORMAT_NAMES  # the names the config validates against (k3post.constants)

# E2M1 magnitudes by 3-bit code (OCP MX v1.0 table 5); codes 8..15 are the negatives.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK_ELEMS = 1 << 20  # 1 Mi elements = 4 MiB of fp32 per temporary
_EXP_MASK = 0x7F800000
_NAN_BYTE = 255


def _e2m1_lut_L() -> torch.Tensor:
    """fp32 values of the 16 E2M1 codes (sign bit 3): [0, .5, ..., 6, -0, -.5, ..., -6]."""
    mags = list(E2M1_VALUES)
    return torch.tensor(mags + [-v for v in mags], dtype=torch.float32)


def _e8m0_lut_L() -> torch.Tensor:
    """fp32 value of every E8M0 byte: 2^(b - 127) for b in 0..254 (b = 0 is the fp32
    subnormal 2^-127, built from its bit pattern so nothing flushes), NaN for 255."""
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 1 << 22  # 2^-127 as an fp32 subnormal
    lut = bits.view(torch.float32).clone()
    lut[_NAN_BYTE] = float("nan")
    return lut


_E2M1_LUT_L = _e2m1_lut_L()
_E8M0_LUT_L = _e8m0_lut_L()
_LUT_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lut_on(name: str, device: torch.device) -> torch.Tensor:
    """The E2M1 ("e2m1") or E8M0 ("e8m0") lookup table on ``device`` (cached)."""
    key = (name, device)
    if key not in _LUT_CACHE:
        _LUT_CACHE[key] = (_E2M1_LUT_L if name == "e2m1" else _E8M0_LUT_L).to(device)
    return _LUT_CACHE[key]


def _check_format(fmt: str) -> MXFormat:
    if fmt not in MX_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; expected one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[fmt]


def _to_blocks(x: torch.Tensor, block_size: int, axis: int) -> tuple[torch.Tensor, int, list[int]]:
    """Move ``axis`` last and view as blocks.

    Returns (x_NB, axis, moved_shape) where moved_shape is x.shape with ``axis`` moved
    last. x_NB is a view when ``axis`` is already last and x is contiguous.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if x.dim() == 0:
        raise ValueError("MX quantization needs a tensor with at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor with {x.dim()} dims")
    axis = axis % x.dim()
    length = x.shape[axis]
    if length % block_size != 0:
        raise ValueError(
            f"length {length} of axis {axis} (shape {tuple(x.shape)}) is not a multiple of "
            f"block_size {block_size}; MX blocks are never padded here, pad the tensor first"
        )
    x_moved = x.movedim(axis, -1) if axis != x.dim() - 1 else x
    moved_shape = list(x_moved.shape)
    return x_moved.reshape(-1, block_size), axis, moved_shape


def _from_blocks(
    t_N_or_NB: torch.Tensor, moved_shape: list[int], axis: int, per_block: bool, block_size: int
) -> torch.Tensor:
    """Inverse of ``_to_blocks``: element tensors t_NB -> shape S (per_block=False) or
    per-block tensors t_N -> shape G (per_block=True)."""
    shape = list(moved_shape)
    if per_block:
        shape[-1] //= block_size
    t = t_N_or_NB.reshape(shape)
    return t.movedim(-1, axis) if axis != len(shape) - 1 else t


def _block_exponents(amax_N: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared exponents of N blocks from their fp32 amax.

    shared = clamp(floor(log2 amax) - emax, -127, 127), floor(log2 amax) read from the
    biased fp32 exponent (exact); amax = NaN/Inf (biased exponent 255) marks a NaN block.

    Returns (scale_bytes_N uint8, inv_scale_N fp32 = 2^-shared, nan_N bool).
    """
    biased_N = (amax_N.view(torch.int32) >> 23) & 0xFF
    nan_N = biased_N == 255
    shared_N = (biased_N - (127 + emax)).clamp_(-127, 127)
    # 2^-shared is always a normal fp32: -shared in [-126, 127] for finite blocks.
    inv_scale_N = ((127 - shared_N).clamp_(1, 254) << 23).view(torch.float32)
    scale_bytes_N = (shared_N + 127).to(torch.uint8).masked_fill_(nan_N, _NAN_BYTE)
    return scale_bytes_N, inv_scale_N, nan_N


def _round_to_grid_(a_NB: torch.Tensor, c_NB: torch.Tensor, spec: MXFormat, want_codes: bool) -> None:
    """Round non-negative fp32 magnitudes ``a_NB`` (all < 2^(emax+1)) onto the element
    grid of ``spec`` with round-to-nearest-even and saturation, in place.

    With e(a) the unbiased fp32 exponent, the grid step at a is
    2^(max(e, emin) - mbits); the fp32 number c = 2^(max(e, emin) - mbits + 23) has
    exactly that ulp, so t = a + c is rounded by the FPU to nearest-even on the step
    grid. RNE on the step grid is the format's RNE (the parity of value/step is the
    code's last mantissa bit), and a carry into the next binade lands on the next
    binade's grid too. Then:

        want_codes=False: a <- min(t - c, max_value)                     (values)
        want_codes=True (E2M1 only):
            a.view(int32) <- min(bits(t) - bits(c) + 2*max(e, 0), 7)      (codes 0..7)
            bits(t) - bits(c) = value / step, and the binade offset 2*max(e, 0) turns
            it into the E2M1 code (code = 2*exponent_field + mantissa_bit).

    ``c_NB`` is an int32 scratch buffer of the same shape. Exact fp32 arithmetic only:
    no float log2, no subnormal intermediates (c and t are normal fp32 numbers).
    """
    shift = 23 - spec.mbits
    ci = c_NB
    torch.bitwise_and(a_NB.view(torch.int32), _EXP_MASK, out=ci)
    ci.clamp_(min=(127 + spec.emin) << 23).add_(shift << 23)
    a_NB.add_(ci.view(torch.float32))
    if not want_codes:
        a_NB.sub_(ci.view(torch.float32)).clamp_(max=spec.max_value)
        return
    assert spec.name == "fp4_e2m1", "codes via the grid rounder are only used for E2M1"
    ai = a_NB.view(torch.int32)
    ai.sub_(ci)
    ci.bitwise_right_shift_(22)  # = 2 * (max(e, 0) + 149) = 2 * max(e, 0) + 298
    ai.add_(ci).sub_(298).clamp_(max=7)


def _sign_bits_(x_NB: torch.Tensor, out_NB: torch.Tensor) -> None:
    """out_NB (int32) <- 8 where x is negative (sign bit set, including -0.0), else 0."""
    torch.bitwise_right_shift(x_NB.view(torch.int32), 31, out=out_NB)
    out_NB.bitwise_and_(8)


def _mx_kernel(
    x_NB: torch.Tensor,
    spec: MXFormat,
    mode: str,
    out_NB: torch.Tensor,
    scales_N: torch.Tensor,
) -> None:
    """Quantize blocks slab by slab (in place on reused fp32/int32 scratch buffers).

    mode "codes": element codes -> out_NB (uint8 for FP4, float8 for FP8).
    mode "fake":  dequantized values -> out_NB (x's dtype).
    Scale bytes -> scales_N in both modes.
    """
    n_blocks, bs = x_NB.shape
    rows = min(max(1, _CHUNK_ELEMS // bs), n_blocks)
    dev = x_NB.device
    a_buf = torch.empty(rows, bs, dtype=torch.float32, device=dev)
    c_buf = torch.empty(rows, bs, dtype=torch.int32, device=dev)
    fp4 = spec.name == "fp4_e2m1"
    s_buf = torch.empty(rows, bs, dtype=torch.int32, device=dev) if fp4 and mode == "codes" else None
    e8m0_lut_L = _lut_on("e8m0", dev)
    for r0 in range(0, n_blocks, rows):
        r1 = min(r0 + rows, n_blocks)
        n = r1 - r0
        xs_NB, a_NB, c_NB, outs_NB = x_NB[r0:r1], a_buf[:n], c_buf[:n], out_NB[r0:r1]
        if x_NB.dtype == torch.float32:
            torch.abs(xs_NB, out=a_NB)
            if s_buf is not None:
                _sign_bits_(xs_NB, s_buf[:n])
        else:
            a_NB.copy_(xs_NB)  # exact widening to fp32
            if s_buf is not None:
                _sign_bits_(a_NB, s_buf[:n])
            a_NB.abs_()
        bytes_N, inv_N, nan_N = _block_exponents(a_NB.amax(dim=1), spec.emax)
        scales_N[r0:r1] = bytes_N
        any_nan = bool(nan_N.any())
        if mode == "codes":
            if fp4:
                assert s_buf is not None
                a_NB.mul_(inv_N[:, None])  # |v| / 2^shared, exact
                _round_to_grid_(a_NB, c_NB, spec, want_codes=True)
                outs_NB.copy_(a_NB.view(torch.int32).bitwise_or_(s_buf[:n]))
            else:
                torch.mul(xs_NB, inv_N[:, None], out=a_NB)  # v / 2^shared, exact
                a_NB.clamp_(-spec.max_value, spec.max_value)  # saturate (NaN stays NaN)
                outs_NB.copy_(a_NB)  # fp32 -> float8 cast: round to nearest even
            if any_nan:
                outs_NB.view(torch.uint8).masked_fill_(nan_N[:, None], 0)
            continue
        # Fake path, all formats: RNE + saturation in fp32 arithmetic (bit-identical to
        # the float8 cast, tested; casting float8 -> fp32 back is ~6x slower on CPU).
        a_NB.mul_(inv_N[:, None])
        _round_to_grid_(a_NB, c_NB, spec, want_codes=False)
        a_NB.copysign_(xs_NB)
        a_NB.mul_(e8m0_lut_L[bytes_N.long()][:, None])  # * 2^shared (NaN for NaN blocks)
        outs_NB.copy_(a_NB)


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"MX quantization supports float32, bfloat16 and float16 inputs, got {x.dtype}")


def quantize_mx(
    x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to an MX format (OCP MX v1.0 conversion).

    For each block of ``block_size`` consecutive elements along ``axis``:

        shared  = clamp(floor(log2(max|v|)) - emax, -127, 127)   (all-zero -> -127)
        scale   = uint8(shared + 127)                             (0xFF if NaN/Inf in block)
        code_i  = RNE_saturate(v_i / 2^shared)                    (onto E2M1 / E4M3 / E5M2)

    Args:
        x_S: float32 / bfloat16 / float16 tensor; ``x.shape[axis] % block_size == 0``.
        fmt: "fp4_e2m1", "fp8_e4m3" or "fp8_e5m2".
        block_size: elements per block (32 in OCP MX).
        axis: the dim the blocks run along (the reduction dim of the GEMM).

    Returns:
        codes_S: FP4 -> uint8, one code per element (bit 3 sign, bits 0-2 E2M1 index
            into ``E2M1_VALUES``); FP8 -> ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
            (``.view(torch.uint8)`` gives the OCP bit pattern). Codes of NaN blocks are 0.
        scales_G: uint8 E8M0 bytes, ``x.shape`` with ``axis`` divided by ``block_size``.

    Raises:
        ValueError: unknown format, unsupported dtype, bad axis / block_size, or an
            ``axis`` length that is not a multiple of ``block_size``.
    """
    spec = _check_format(fmt)
    _check_input(x)
    x_NB, axis_n, moved_shape = _to_blocks(x, block_size, axis)
    codes_NB = torch.empty(x_NB.shape, dtype=spec.torch_dtype, device=x.device)
    scales_N = torch.empty(x_NB.shape[0], dtype=torch.uint8, device=x.device)
    if x_NB.numel() > 0:
        _mx_kernel(x_NB, spec, "codes", codes_NB, scales_N)
    codes_S = _from_blocks(codes_NB, moved_shape, axis_n, False, block_size)
    scales_G = _from_blocks(scales_N, moved_shape, axis_n, True, block_size)
    return codes_S, scales_G


def dequantize_mx(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block_size: int = 32,
    axis: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode MX codes: v_hat_i = 2^(scale_byte - 127) * element_value(code_i).

    Byte 0xFF (NaN scale) makes the whole block NaN. The product is formed in float32
    (exact: at most 4 significant bits times a power of two >= 2^-127) and cast to
    ``dtype``.

    Args:
        codes_S: as returned by ``quantize_mx`` (FP4: uint8 codes 0..15, unpacked; FP8:
            float8 tensor of the format's dtype or its uint8 bit pattern).
        scales_G: uint8 E8M0 bytes, ``codes.shape`` with ``axis`` divided by block_size.
        fmt, block_size, axis: as given to ``quantize_mx``.
        dtype: output dtype.

    Returns:
        x_hat_S in ``dtype``.
    """
    spec = _check_format(fmt)
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8 E8M0 bytes, got {scales.dtype}")
    if spec.name == "fp4_e2m1":
        if codes.dtype != torch.uint8:
            raise ValueError(f"fp4_e2m1 codes must be uint8 (unpacked, one per element), got {codes.dtype}")
    elif codes.dtype == torch.uint8:
        codes = codes.view(spec.torch_dtype)
    elif codes.dtype != spec.torch_dtype:
        raise ValueError(f"{fmt} codes must be {spec.torch_dtype} or uint8, got {codes.dtype}")
    c_NB, axis_n, moved_shape = _to_blocks(codes, block_size, axis)
    expected = list(moved_shape)
    expected[-1] //= block_size
    s_moved = scales.movedim(axis_n, -1) if axis_n != scales.dim() - 1 else scales
    if scales.dim() != codes.dim() or list(s_moved.shape) != expected:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match codes shape {tuple(codes.shape)} "
            f"with block_size {block_size} along axis {axis}"
        )
    scale_N = _lut_on("e8m0", codes.device)[s_moved.reshape(-1).long()]
    if spec.name == "fp4_e2m1":
        if c_NB.numel() > 0 and int(c_NB.max()) > 15:
            raise ValueError("fp4_e2m1 codes must be in 0..15 (did you pass packed bytes? use unpack_fp4)")
        v_NB = _lut_on("e2m1", codes.device)[c_NB.long()]
    else:
        v_NB = c_NB.to(torch.float32)
    v_NB.mul_(scale_N[:, None])
    return _from_blocks(v_NB.to(dtype), moved_shape, axis_n, False, block_size)


_EXP_MASK = 0x7F800000  # fp32 exponent bits


def fake_quant_fp8_lastdim(x_S: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """``fake_quant_mx(x, fmt, block_size, -1)`` for a float32 x and an MXFP8 format in few ops, without input
    checks (the caller's: x float32, its last dim a multiple of ``block_size``, fmt an FP8 format) and
    bit-identical (tested): the hot path of QAT activations and of the engine's decode steps, where tensors are
    small and per-op overhead dominates. Blocks along the last dim; with amax the block's largest |x| and emax,
    emin, mbits, max of the element format (OCP MX v1.0):

        2^shared = 2^(floor(log2 amax) - emax), at least 2^-127
        a        = |x| / 2^shared                                         (exact)
        c        = 2^(max(floor(log2 a), emin) - mbits + 23)
        q        = min((a + c) - c, max) * sign(x) * 2^shared

    (a + c) - c rounds a to the element grid with the FPU's ties-to-even (c's ulp is the grid step at a), as
    ``_mx_kernel`` does; floor(log2) is read from the fp32 exponent bits. An all-zero block gives zeros; a
    block holding NaN / Inf gives NaNs (the NaN scale: its amax's exponent bits read as +Inf)."""
    spec = MX_FORMATS[fmt]
    x_NB = x_S.detach().reshape(-1, block_size)
    a_NB = x_NB.abs()
    pow2_N1 = a_NB.amax(1, keepdim=True).view(torch.int32).bitwise_and_(_EXP_MASK).view(torch.float32)
    scale_N1 = pow2_N1.clamp_(min=2.0 ** (spec.emax - 127)).mul_(2.0 ** -spec.emax)
    a_NB.div_(scale_N1)
    c_NB = a_NB.view(torch.int32).bitwise_and(_EXP_MASK).clamp_(min=(127 + spec.emin) << 23)
    c_NB = c_NB.add_((23 - spec.mbits) << 23).view(torch.float32)
    a_NB.add_(c_NB).sub_(c_NB).clamp_(max=spec.max_value).copysign_(x_NB).mul_(scale_N1)
    return a_NB.view(x_S.shape)


def fake_quant_mx(x: torch.Tensor, fmt: str, block_size: int = 32, axis: int = -1) -> torch.Tensor:
    """MX fake quantization: ``dequantize_mx(*quantize_mx(x, ...), dtype=x.dtype)``.

    Computed in one fused pass (no codes materialised) and bit-identical to the
    composition (tested). Idempotent: fake_quant(fake_quant(x)) == fake_quant(x).
    No autograd of its own; wrap it in a straight-through estimator for QAT.

    Args:
        x_S: float32 / bfloat16 / float16; ``x.shape[axis] % block_size == 0``.
        fmt, block_size, axis: as in ``quantize_mx``.

    Returns:
        x_hat_S: same shape and dtype as x, every block on 2^shared * {element grid}.
    """
    spec = _check_format(fmt)
    _check_input(x)
    x_NB, axis_n, moved_shape = _to_blocks(x.detach(), block_size, axis)
    if (spec.name != "fp4_e2m1" and x.dtype == torch.float32 and axis_n == x.dim() - 1
            and 0 < x_NB.numel() <= _CHUNK_ELEMS):  # the few-op form: activations and small tensors
        return fake_quant_fp8_lastdim(x_NB, fmt, block_size).view(x.shape)
    out_NB = torch.empty(x_NB.shape, dtype=x.dtype, device=x.device)
    scales_N = torch.empty(x_NB.shape[0], dtype=torch.uint8, device=x.device)
    if x_NB.numel() > 0:
        _mx_kernel(x_NB, spec, "fake", out_NB, scales_N)
    out_S = _from_blocks(out_NB, moved_shape, axis_n, False, block_size)
    return out_S.contiguous() if axis_n != x.dim() - 1 else out_S


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last axis: byte_j = c_{2j} | c_{2j+1} << 4
    (low nibble = even element, as in OCP / gpt-oss ``*_blocks``).

    Args:
        codes_S: uint8 codes 0..15, last dim even.

    Returns:
        packed_P: uint8, last dim halved.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() > 0 and int(codes.max()) > 15:
        raise ValueError("pack_fp4 expects 4-bit codes (0..15)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: packed_P uint8 -> codes_S uint8 with the last dim doubled
    (element 2j = low nibble of byte j, element 2j+1 = high nibble)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_fp4 needs at least one dimension")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
