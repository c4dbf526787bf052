"""MX (OCP Microscaling v1.0) quantizer: hand-derived golden values + reference parity.

Shape legend: B block (32 elements), N blocks, R rows.

Conventions used in the derivations: for a block with max |v| = amax,
    shared = clamp(floor(log2 amax) - emax, -127, 127), byte = shared + 127,
    element = RNE_saturate(v / 2^shared), emax = 2 (E2M1), 8 (E4M3), 15 (E5M2).
E2M1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3post.quant import E2M1_VALUES, dequantize_mx, fake_quant_mx, pack_fp4, quantize_mx, unpack_fp4

B = 32


def _block(vals: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One 32-element block: ``vals`` followed by zeros, shape [1, 32]."""
    return torch.tensor(vals + [0.0] * (B - len(vals)), dtype=dtype).reshape(1, B)


# --------------------------------------------------------------------------- E2M1


def test_all_16_e2m1_codes_decode():
    # scale byte 127 -> 2^0; codes 0..15 twice fill the block.
    codes_RB = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, B)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = torch.tensor((mags + [-m for m in mags]) * 2).reshape(1, B)
    got = dequantize_mx(codes_RB, torch.tensor([[127]], dtype=torch.uint8), "fp4_e2m1")
    assert torch.equal(got, expected)
    assert torch.equal(got[0, 8].signbit(), torch.tensor(True))  # code 8 is -0.0
    # byte 128 -> 2^1 doubles every value; byte 125 -> 2^-2 quarters it (exact).
    assert torch.equal(dequantize_mx(codes_RB, torch.tensor([[128]], dtype=torch.uint8), "fp4_e2m1"), expected * 2)
    assert torch.equal(dequantize_mx(codes_RB, torch.tensor([[125]], dtype=torch.uint8), "fp4_e2m1"), expected / 4)
    assert E2M1_VALUES == tuple(mags)


def test_e2m1_ties_to_even_at_scale_one():
    # amax 6 -> floor(log2 6) = 2 -> shared 2 - 2 = 0 -> byte 127, elements = v.
    # ties (midpoints) go to the even code:
    #   0.25: 0 (c0) | 0.5 (c1)  -> c0 = 0      0.75: 0.5 (c1) | 1 (c2)  -> c2 = 1
    #   1.25: 1 (c2) | 1.5 (c3)  -> c2 = 1      1.75: 1.5 (c3) | 2 (c4)  -> c4 = 2
    #   2.5:  2 (c4) | 3 (c5)    -> c4 = 2      3.5:  3 (c5) | 4 (c6)    -> c6 = 4
    #   5:    4 (c6) | 6 (c7)    -> c6 = 4      6 -> c7; -0.25 -> -0 (c8); -5 -> -4 (c14)
    x = _block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, -1.75])
    codes, scales = quantize_mx(x, "fp4_e2m1")
    assert scales.tolist() == [[127]]
    assert codes[0, :11].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 14, 12]
    deq = dequantize_mx(codes, scales, "fp4_e2m1")
    assert deq[0, :11].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0, -2.0]


def test_e2m1_just_off_ties_round_to_nearest():
    # one fp32 ulp above / below each midpoint breaks the tie: 0.25+ -> 0.5, 0.75- -> 0.5,
    # 2.5+ -> 3, 3.5- -> 3, 5+ -> 6 (amax 6, scale 1 as above).
    def up(v: float) -> float:
        return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()

    def dn(v: float) -> float:
        return torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)).item()

    x = _block([up(0.25), dn(0.75), up(2.5), dn(3.5), up(5.0), 6.0])
    assert fake_quant_mx(x, "fp4_e2m1")[0, :6].tolist() == [0.5, 0.5, 3.0, 3.0, 6.0, 6.0]


def test_e2m1_saturation_and_scaled_block():
    # amax 7: floor(log2 7) = 2 -> shared 0; 7 would round (tie 6|8, even -> 8) past the
    # max and saturates to 6 (code 7); 7.9 too; -7 -> -6 (code 15).
    codes, scales = quantize_mx(_block([7.0, 7.9, -7.0, 1.0]), "fp4_e2m1")
    assert scales.tolist() == [[127]] and codes[0, :4].tolist() == [7, 7, 15, 2]
    # amax 12: floor(log2 12) = 3 -> shared 1 -> byte 128; 12/2 = 6 (c7);
    # 3.1/2 = 1.55 -> 1.5 (c3) -> 3.0; 0.4/2 = 0.2 -> 0 (c0).
    x = _block([12.0, 3.1, 0.4])
    codes, scales = quantize_mx(x, "fp4_e2m1")
    assert scales.tolist() == [[128]] and codes[0, :3].tolist() == [7, 3, 0]
    assert fake_quant_mx(x, "fp4_e2m1")[0, :3].tolist() == [12.0, 3.0, 0.0]


def test_scale_extremes_near_2_pow_pm127():
    # All-zero block -> smallest scale: byte 0 (2^-127), codes 0.
    codes, scales = quantize_mx(torch.zeros(1, B), "fp4_e2m1")
    assert scales.tolist() == [[0]] and codes.sum() == 0
    # amax 2^-125: shared = -125 - 2 = -127 -> byte 0; 2^-125 / 2^-127 = 4 (c6); dequant
    # 4 * 2^-127 = 2^-125 exactly (the 2^-127 scale is an fp32 subnormal, no flush).
    x = _block([2.0**-125, 1.5 * 2.0**-126])
    codes, scales = quantize_mx(x, "fp4_e2m1")
    # 1.5*2^-126 / 2^-127 = 3 -> c5
    assert scales.tolist() == [[0]] and codes[0, :2].tolist() == [6, 5]
    assert torch.equal(dequantize_mx(codes, scales, "fp4_e2m1"), x)
    # amax 2^-130 (fp32 subnormal): shared -132 clamps to -127 -> byte 0;
    # 2^-130 / 2^-127 = 0.125 < 0.25 -> 0.
    codes, scales = quantize_mx(_block([2.0**-130]), "fp4_e2m1")
    assert scales.tolist() == [[0]] and codes[0, 0].item() == 0
    # amax 2^-120 in E4M3: shared = -120 - 8 = -128 -> clamp -127 -> byte 0;
    # 2^-120 / 2^-127 = 128 exactly representable -> round trip exact.
    x = _block([2.0**-120, -(2.0**-126)])
    codes, scales = quantize_mx(x, "fp8_e4m3")
    assert scales.tolist() == [[0]]
    assert torch.equal(dequantize_mx(codes, scales, "fp8_e4m3"), x)
    # Huge: amax 2^127 -> shared 127 - 2 = 125 -> byte 252; 2^127/2^125 = 4 (c6).
    codes, scales = quantize_mx(_block([2.0**127]), "fp4_e2m1")
    assert scales.tolist() == [[252]] and codes[0, 0].item() == 6
    # fp32 max = (2 - 2^-23) * 2^127: shared 125; scaled 7.99999952 -> saturates to 6
    # -> 6 * 2^125 = 1.5 * 2^127.
    fmax = torch.finfo(torch.float32).max
    assert fake_quant_mx(_block([fmax]), "fp4_e2m1")[0, 0].item() == 1.5 * 2.0**127
    # E4M3 2^127: shared 127 - 8 = 119 -> byte 246; E5M2: 127 - 15 = 112 -> byte 239.
    assert quantize_mx(_block([2.0**127]), "fp8_e4m3")[1].tolist() == [[246]]
    assert quantize_mx(_block([2.0**127]), "fp8_e5m2")[1].tolist() == [[239]]


def test_exponent_exact_near_powers_of_two():
    # amax = 4 - 1ulp: floor(log2) = 1 -> shared -1 -> byte 126 (a float log2 rounds
    # this to 2.0 and gets byte 127); amax exactly 4 -> shared 0 -> byte 127.
    below4 = torch.nextafter(torch.tensor(4.0), torch.tensor(0.0)).item()
    assert quantize_mx(_block([below4]), "fp4_e2m1")[1].tolist() == [[126]]
    assert quantize_mx(_block([4.0]), "fp4_e2m1")[1].tolist() == [[127]]
    # below4 / 2^-1 = 8 - 2ulp -> saturates to 6 -> 3.0
    assert fake_quant_mx(_block([below4]), "fp4_e2m1")[0, 0].item() == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    # Same golden block as the tie test; every value is exact in bf16 and fp16.
    x = _block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0], dtype)
    codes, scales = quantize_mx(x, "fp4_e2m1")
    assert scales.tolist() == [[127]] and codes[0, :10].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 14]
    y = fake_quant_mx(x, "fp4_e2m1")
    assert y.dtype == dtype
    assert y[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0]
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(4, 64, generator=g) * torch.logspace(-3, 3, 4)[:, None]).to(dtype)
    for fmt in ("fp4_e2m1", "fp8_e4m3", "fp8_e5m2"):
        assert torch.equal(fake_quant_mx(r, fmt), dequantize_mx(*quantize_mx(r, fmt), fmt, dtype=dtype))


# --------------------------------------------------------------------------- FP8


def test_fp8_e4m3_golden():
    # amax 448 -> floor(log2 448) = 8 -> shared 0 -> byte 127, elements = v.
    # E4M3 step in [1, 2) is 1/8: 1.0625 is the 1|1.125 midpoint -> even mantissa -> 1.0;
    # 1.1875 (1.125|1.25) -> 1.25. Subnormal step 2^-9: 2^-10 (0|2^-9) -> 0;
    # 3*2^-10 (2^-9 odd | 2^-8 even) -> 2^-8. 500 -> saturate 448 (0x7E); -1000 -> -448 (0xFE).
    x = _block([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -448.0])
    codes, scales = quantize_mx(x, "fp8_e4m3")
    assert codes.dtype == torch.float8_e4m3fn and scales.tolist() == [[127]]
    assert codes.view(torch.uint8)[0, :6].tolist() == [0x7E, 0x38, 0x3A, 0x00, 0x02, 0xFE]
    assert fake_quant_mx(x, "fp8_e4m3")[0, :6].tolist() == [448.0, 1.0, 1.25, 0.0, 2.0**-8, -448.0]
    # Saturation: amax 500 -> floor(log2 500) = 8 -> shared 0; 500 > 448 -> 448; 480 is not
    # an E4M3FN value (that pattern is NaN) -> 448.
    codes, scales = quantize_mx(_block([500.0, 480.0, -460.0]), "fp8_e4m3")
    assert scales.tolist() == [[127]] and codes.float()[0, :3].tolist() == [448.0, 448.0, -448.0]
    # uint8 bit patterns are accepted by dequantize_mx.
    assert torch.equal(dequantize_mx(codes.view(torch.uint8), scales, "fp8_e4m3"), dequantize_mx(codes, scales, "fp8_e4m3"))


def test_fp8_e5m2_golden():
    # amax 57344 = 1.75 * 2^15 -> shared 15 - 15 = 0. E5M2 step in [1, 2) is 1/4:
    # 1.125 (1|1.25) -> 1.0 (0x3C); 1.375 (1.25|1.5) -> 1.5 (0x3E); 57344 -> 0x7B.
    x = _block([57344.0, 1.125, 1.375])
    codes, scales = quantize_mx(x, "fp8_e5m2")
    assert codes.dtype == torch.float8_e5m2 and scales.tolist() == [[127]]
    assert codes.view(torch.uint8)[0, :3].tolist() == [0x7B, 0x3C, 0x3E]
    # 60000: floor(log2) = 15 -> shared 0, 60000 > 57344 saturates.
    assert fake_quant_mx(_block([60000.0, -60000.0]), "fp8_e5m2")[0, :2].tolist() == [57344.0, -57344.0]
    # amax 1: shared 0 - 15 = -15 -> byte 112; 1 -> 2^15 / 2^15.
    assert quantize_mx(_block([1.0]), "fp8_e5m2")[1].tolist() == [[112]]


# --------------------------------------------------------------------------- specials, errors, axes


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"])
def test_nan_inf_block(fmt):
    # Row 0 holds a NaN, row 1 an Inf, row 2 is finite: rows 0-1 get byte 0xFF, codes 0,
    # and dequantize to all-NaN; row 2 is untouched (amax 6 -> fp4 byte 127).
    x = torch.zeros(3, B)
    x[0, 3] = float("nan")
    x[1, 5] = float("-inf")
    x[:, 0] = 6.0
    codes, scales = quantize_mx(x, fmt)
    assert scales[:2].tolist() == [[255], [255]]
    assert codes.view(torch.uint8)[:2].sum().item() == 0
    deq = dequantize_mx(codes, scales, fmt)
    assert deq[:2].isnan().all() and not deq[2].isnan().any()
    assert deq[2, 0].item() == 6.0
    fq = fake_quant_mx(x, fmt)
    assert fq[:2].isnan().all() and torch.equal(fq[2], deq[2])


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        quantize_mx(torch.zeros(2, 48), "fp4_e2m1")
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        fake_quant_mx(torch.zeros(40, 32), "fp8_e4m3", axis=0)
    with pytest.raises(ValueError, match="unknown MX format"):
        quantize_mx(torch.zeros(32), "fp6_e3m2")
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        quantize_mx(torch.zeros(32, dtype=torch.int32), "fp4_e2m1")
    with pytest.raises(ValueError, match="block_size"):
        quantize_mx(torch.zeros(32), "fp4_e2m1", block_size=0)
    with pytest.raises(ValueError, match="axis"):
        quantize_mx(torch.zeros(32), "fp4_e2m1", axis=1)
    with pytest.raises(ValueError, match="0..15"):
        dequantize_mx(torch.full((1, 32), 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), "fp4_e2m1")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_mx(torch.zeros(1, 64, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), "fp4_e2m1")
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp8_e4m3"])
def test_axis0_matches_transpose(fmt):
    # Blocks along axis 0 of x [64, 3] are blocks along axis -1 of x.T [3, 64].
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    codes, scales = quantize_mx(x, fmt, axis=0)
    codes_t, scales_t = quantize_mx(x.T.contiguous(), fmt)
    assert scales.shape == (2, 3) and torch.equal(scales, scales_t.T)
    assert torch.equal(codes.view(torch.uint8), codes_t.view(torch.uint8).T)
    deq = dequantize_mx(codes, scales, fmt, axis=0)
    assert torch.equal(deq, fake_quant_mx(x, fmt, axis=0))
    assert torch.equal(deq, fake_quant_mx(x.T.contiguous(), fmt).T)
    # 3-D, middle axis, block 16
    y = torch.randn(2, 32, 5, generator=g)
    assert torch.equal(fake_quant_mx(y, fmt, 16, axis=1), fake_quant_mx(y.transpose(1, 2).contiguous(), fmt, 16).transpose(1, 2))


def test_pack_unpack():
    # codes [1, 2, 15, 0] -> bytes [1 | 2<<4, 15 | 0<<4] = [0x21, 0x0F]
    packed = pack_fp4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F]
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 4, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 4, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    c, _ = quantize_mx(torch.randn(8, 64, generator=g), "fp4_e2m1")
    assert torch.equal(unpack_fp4(pack_fp4(c)), c)


# --------------------------------------------------------------------------- reference parity


def _grid(fmt: str) -> list[float]:
    """All non-negative finite element values in code order (so code parity = last
    mantissa bit), from the float8 dtypes / E2M1 table."""
    if fmt == "fp4_e2m1":
        return list(E2M1_VALUES)
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    vals = torch.arange(128, dtype=torch.uint8).view(dtype).float().tolist()
    return [v for v in vals if math.isfinite(v)]


_EMAX = {"fp4_e2m1": 2, "fp8_e4m3": 8, "fp8_e5m2": 15}


def _reference_fake_quant(row: list[float], fmt: str) -> list[float]:
    """Slow per-element OCP MX reference in float64 (one block)."""
    grid = _grid(fmt)
    amax = max(abs(v) for v in row)
    shared = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - _EMAX[fmt]))
    out = []
    for v in row:
        a = abs(v) / 2.0**shared
        if a >= grid[-1]:
            q = grid[-1]
        else:
            i = max(k for k, g in enumerate(grid) if g <= a)
            lo, hi = grid[i], grid[i + 1]
            q = lo if (a - lo < hi - a or (a - lo == hi - a and i % 2 == 0)) else hi
        out.append(math.copysign(q * 2.0**shared, v))
    return out


_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    vals=st.lists(_finite, min_size=B, max_size=B),
    exp_shift=st.integers(-140, 100),
    fmt=st.sampled_from(["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"]),
)
def test_matches_reference_and_roundtrip(vals, exp_shift, fmt):
    x = torch.tensor(vals, dtype=torch.float32) * torch.tensor(2.0**exp_shift, dtype=torch.float64).float()
    x = x.reshape(1, B)
    if not torch.isfinite(x).all():
        return
    fq = fake_quant_mx(x, fmt)
    ref = torch.tensor(_reference_fake_quant(x[0].double().tolist(), fmt), dtype=torch.float64)
    assert torch.equal(fq[0].double(), ref)
    # fake == dequantize(quantize) bit for bit (fp8: float8 cast == fp32 RNE arithmetic)
    assert torch.equal(fq, dequantize_mx(*quantize_mx(x, fmt), fmt))
    # idempotent
    assert torch.equal(fake_quant_mx(fq, fmt), fq)


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"])
def test_every_midpoint_tie_matches_reference(fmt):
    # Every midpoint between adjacent grid values, 31 per block plus the format max (so
    # amax = max -> shared 0 -> scale 1): each is an exact tie resolved to the even code.
    grid = _grid(fmt)
    mids = [(lo + hi) / 2 for lo, hi in zip(grid[:-1], grid[1:])]
    mids += [0.0] * (-len(mids) % 31)
    rows = [mids[i : i + 31] + [grid[-1]] for i in range(0, len(mids), 31)]
    x_RB = torch.tensor(rows, dtype=torch.float32)
    x_RB = torch.cat([x_RB, -x_RB])
    fq = fake_quant_mx(x_RB, fmt)
    assert quantize_mx(x_RB, fmt)[1].eq(127).all()
    for r in range(x_RB.shape[0]):
        assert fq[r].double().tolist() == _reference_fake_quant(x_RB[r].double().tolist(), fmt)
    assert torch.equal(fq, dequantize_mx(*quantize_mx(x_RB, fmt), fmt))  # torch float8 cast agrees


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"])
def test_idempotent_and_on_grid_large(fmt):
    # 256 rows of 2 blocks with magnitudes from 1e-30 to 1e30.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-30, 30, 256)[:, None]
    grid = torch.tensor(_grid(fmt))
    fq = fake_quant_mx(x, fmt)
    assert torch.equal(fake_quant_mx(fq, fmt), fq)
    assert torch.equal(fq, dequantize_mx(*quantize_mx(x, fmt), fmt))
    _, scales = quantize_mx(x, fmt)
    scale_RN = torch.ldexp(torch.ones((), dtype=torch.float64), scales.double() - 127)
    mags = (fq.double().abs().reshape(-1, 2, 32) / scale_RN[..., None]).reshape(-1)
    assert torch.isin(mags, grid.double()).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_few_op_form_equals_the_kernel(fmt, monkeypatch):
    """fake_quant_mx's few-op form (float32, last axis: `fake_quant_fp8_lastdim`) against the blocked kernel it
    replaced there (forced by a chunk size of 0), bit for bit, over wide-range values, exact grid midpoints,
    subnormals, zero blocks and NaN / Inf blocks."""
    from k3post.quant import mx

    g = torch.Generator().manual_seed(7)
    wide = torch.randn(64, 96, generator=g) * torch.pow(2.0, torch.randint(-140, 120, (64, 96), generator=g).float())
    spec = mx.MX_FORMATS[fmt]
    step = 2.0 ** (-spec.mbits)  # midpoints of the grid [1, 2): ties to even
    ties = (1.0 + step * (torch.arange(96, dtype=torch.float32) % (2 ** spec.mbits) + 0.5)).repeat(8, 1)
    ties[:, 0] = 8.0 * 2.0 ** spec.emax  # amax fixes the scale at 2^3
    special = torch.zeros(6, 96)
    special[1] = 1e-40  # subnormal
    special[2, 5] = float("nan")
    special[3, 40] = float("inf")
    special[4, 70] = -float("inf")
    special[5] = -3.0
    x = torch.cat([wide, ties, special])
    fast = mx.fake_quant_mx(x, fmt, 32, -1)
    monkeypatch.setattr(mx, "_CHUNK_ELEMS", 0)
    kernel = mx.fake_quant_mx(x, fmt, 32, -1)
    assert torch.equal(fast.isnan(), kernel.isnan())
    assert torch.equal(fast.nan_to_num().view(torch.int32), kernel.nan_to_num().view(torch.int32))
    assert torch.equal(mx.fake_quant_fp8_lastdim(x, fmt, 32).nan_to_num().view(torch.int32), kernel.nan_to_num().view(torch.int32))
