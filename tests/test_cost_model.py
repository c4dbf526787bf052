"""k3post.rollout.cost_model: a step priced from its work (golden values by hand), the linear fit
recovers its coefficients and its table prices them exactly, and a bad curve file names the file and
the key.

Shape legend: none.
"""

from __future__ import annotations

import json
import random

import pytest

from k3post.rollout.cost_model import CostCurve, StepWork, fit_linear, predict_engine_s, step_work_summary


def _curve(**kw) -> CostCurve:
    d = dict(batches=[1, 3], contexts=[100, 300], decode_ms=[[1.0, 2.0], [3.0, 5.0]], prefill_tokens=[10, 110],
             prefill_ms=[2.0, 4.0], source="hand-made")
    d.update(kw)
    return CostCurve(**d)


def test_decode_cost_is_bilinear_in_rows_and_context_and_linear_beyond():
    c = _curve()
    assert c.decode_step_ms(1, 100) == 1.0 and c.decode_step_ms(3, 300) == 5.0
    # rows 2 is halfway between 1 and 3: (2, 3.5) at contexts (100, 300); context 200 halfway again
    assert c.decode_step_ms(2, 200) == pytest.approx(2.75, abs=1e-12)
    # 6 rows: twice the cost of the largest measured batch (3 rows) at that context
    assert c.decode_step_ms(6, 200) == pytest.approx(2 * 4.0, abs=1e-12)
    # context 500, one row: the last slope (1 -> 2 over 200 positions) continued: 3
    assert c.decode_step_ms(1, 500) == pytest.approx(3.0, abs=1e-12)
    assert c.decode_step_ms(0, 0) == 0.0


def test_prefill_and_mixed_steps_pay_the_fixed_cost_once():
    c = _curve()
    # default fixed cost: the decode line over rows (1 -> 1 ms, 3 -> 3 ms at context 100) at 0 rows is 0
    assert c.step_ms == 0.0
    c = _curve(decode_ms=[[1.0, 2.0], [2.0, 5.0]])  # line 0.5 + 0.5·rows at context 100
    assert c.step_ms == pytest.approx(0.5)
    assert c.prefill_step_ms(60) == pytest.approx(3.0)  # halfway between 10 -> 2 ms and 110 -> 4 ms
    assert c.prefill_step_ms(210) == pytest.approx(6.0)  # the last slope, 0.02 ms a token
    w = StepWork(rows=1, context=100, prefill=60)
    assert c.price(w) == pytest.approx(1.0 + 3.0 - 0.5)
    assert c.price(StepWork(0, 0, 60)) == pytest.approx(3.0)
    trace = [StepWork(1, 100, 0), StepWork(1, 100, 60), StepWork(0, 0, 10)]
    assert predict_engine_s(trace, c) == pytest.approx((1.0 + 3.5 + 2.0) / 1000)
    summ = step_work_summary(trace)
    assert summ["steps"] == 3 and summ["decode_tokens"] == 2 and summ["prefill_tokens"] == 70
    assert summ["mean_rows"] == 1.0 and summ["mean_context"] == 100.0


def test_fit_linear_recovers_the_coefficients_and_its_table_is_exact():
    a, b, cc, d, e = 0.4, 0.04, 6e-5, 3.0, 0.015
    rng = random.Random(0)
    work = []
    for _ in range(400):
        rows = rng.randint(0, 40)
        ctx = rows * rng.randint(50, 3000)
        pre = rng.choice([0, 0, 0, rng.randint(1, 3000)]) if rows else rng.randint(1, 3000)
        work.append(StepWork(rows, ctx, pre))
    ms = [a + b * w.rows + cc * w.context + d * (w.prefill > 0) + e * w.prefill for w in work]
    curve = fit_linear(work, [m / 1000 for m in ms], "synthetic")
    lin = curve.meta["linear"]
    for got, want in zip((lin["a_ms"], lin["b_ms_per_row"], lin["c_ms_per_context"], lin["d_ms_prefill_step"],
                          lin["e_ms_per_prefill_token"]), (a, b, cc, d, e)):
        assert got == pytest.approx(want, rel=1e-8, abs=1e-10)
    assert lin["r2"] == pytest.approx(1.0)
    # the bilinear table reproduces a + b·rows + c·context exactly, inside the grid and past it
    for w, m in zip(work, ms):
        assert curve.price(w) == pytest.approx(m, rel=1e-9), w
    assert curve.step_ms == pytest.approx(a)
    with pytest.raises(ValueError, match="do not vary enough"):
        fit_linear([StepWork(1, 100, 0)] * 10, [0.001] * 10, "flat")


def test_curve_files_round_trip_and_bad_ones_name_the_file_and_key(tmp_path):
    c = _curve(outside_ms_per_turn=1.5)
    p = c.save(tmp_path / "c.json")
    back = CostCurve.load(p)
    assert back == c
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**c.to_dict(), "decod_ms": []}))
    with pytest.raises(ValueError, match=r"bad\.json: unknown keys \['decod_ms'\]"):
        CostCurve.load(bad)
    d = c.to_dict()
    del d["source"]
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad\.json: missing keys \['source'\]"):
        CostCurve.load(bad)
    bad.write_text(json.dumps({**c.to_dict(), "decode_ms": [[1.0], [2.0]]}))
    with pytest.raises(ValueError, match=r"bad\.json: CostCurve\.decode_ms must be 2 rows"):
        CostCurve.load(bad)
    bad.write_text(json.dumps({**c.to_dict(), "decode_ms": [[1.0, -2.0], [3.0, 5.0]]}))
    with pytest.raises(ValueError, match=r"decode_ms\[0\]\[1\] must be a finite number > 0"):
        CostCurve.load(bad)
    bad.write_text('{"batches": [1,\n oops}')
    with pytest.raises(ValueError, match=r"bad\.json: not JSON \(line 2"):
        CostCurve.load(bad)
    with pytest.raises(ValueError, match="increasing"):
        _curve(batches=[3, 1])
    with pytest.raises(ValueError, match="source"):
        _curve(source=" ")


def test_step_cost_bench_writes_a_curve_the_model_loads(tmp_path, one_torch_thread):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_step_cost", Path(__file__).parents[1] / "bench" / "step_cost.py")
    sc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sc)  # type: ignore[union-attr]
    out = tmp_path / "curve.json"
    sc.main(["--out", str(out), "--batches", "1,4", "--contexts", "32,96", "--prefill", "8,64", "--steps", "2",
             "--repeats", "1", "--hidden", "32", "--moe", "32", "--vocab", "300"])
    curve = CostCurve.load(out)
    assert curve.batches == [1, 4] and curve.contexts == [32, 96] and curve.prefill_tokens == [8, 64]
    assert len(curve.decode_ms) == 2 and all(len(r) == 2 and min(r) > 0 for r in curve.decode_ms)
    assert "bench/step_cost.py" in curve.source and "hidden 32" in curve.source
    assert curve.meta["setup"]["batches"] == [1, 4]


def test_the_shipped_curves_load_and_cite_their_source():
    from pathlib import Path

    files = sorted((Path(__file__).parents[1] / "bench" / "curves").glob("*.json"))
    assert len(files) >= 4
    for f in files:
        c = CostCurve.load(f)
        assert ("H200" in c.source) == f.name.startswith("h200") and "2026-" in c.source, f.name
        # a GPU curve at small batch is nearly flat; the CPU's grows with rows (the point of issue 32 §partial)
        flat = c.decode_step_ms(8, 1024) / c.decode_step_ms(1, 1024)
        assert flat < 1.6 if f.name.startswith("h200") else flat > 1.6, (f.name, flat)
