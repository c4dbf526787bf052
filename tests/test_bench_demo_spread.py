"""bench/demo_spread.py: the spread of the demo's headline numbers over runs, from summary.json files."""

from __future__ import annotations

import json

import pytest

from k3post.stats import paired_change, wilson_interval

from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def spread_mod():
    return load_bench("demo_spread")


def _summary(sft_max: float, before: list[bool], after: list[bool], status: str = "done") -> dict:
    n = len(before)
    return {"status": status, "wall_s": 1000.0 + 100 * sft_max,
            "eval": {"sft": {"max": {"pass_rate": sft_max, "n": 400}}},
            "experts": {"general.max": {"sft_pass_rate": sum(before) / n, "pass_rate": sum(after) / n,
                                        "change": paired_change(before, after), "mean_effort_tokens": 19.5,
                                        "rollout_gap": {"mean": 2e-7, "max": 8e-6, "tokens": 900.0}}}}


def test_spread_over_runs(spread_mod, tmp_path, capsys):
    a = [True] * 40 + [False] * 60
    b = [True] * 40 + [True] * 30 + [False] * 30  # 30 discordant, all gains: higher
    runs = {"s0": _summary(0.30, a, b), "s1": _summary(0.56, a, a), "s2": _summary(0.9, a, b, status="running")}
    for name, s in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    assert spread_mod.main([str(tmp_path / n) for n in runs] + ["--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr()
    assert "skipped" in out.err and "status 'running'" in out.err
    sp = json.loads((tmp_path / "out.json").read_text())
    assert sp["runs"] == ["s0", "s1"]
    r = sp["rates"]["sft.max"]
    assert (r["min"], r["max"], r["median"]) == (0.30, 0.56, pytest.approx(0.43))
    assert r["lowest_ci95_lo"] == pytest.approx(wilson_interval(120, 400)[0], abs=1e-4)
    assert r["highest_ci95_hi"] == pytest.approx(wilson_interval(224, 400)[1], abs=1e-4)
    ch = sp["paired"]["expert.general.max.change"]
    assert ch["verdicts"] == {"higher": 1, "no significant change": 1}
    assert (ch["delta_min"], ch["delta_max"]) == (0.0, pytest.approx(0.3))
    assert sp["rates"]["expert.general.max"]["per_run"][0]["n"] == 100
    assert sp["values"]["expert.general.max.rollout_gap_max"]["max"] == 8e-6
    assert "SFT with MXFP4 QAT @ max: 0.300–0.560" in out.out


def test_no_finished_run_is_an_error(spread_mod, tmp_path, capsys):
    (tmp_path / "r").mkdir()
    assert spread_mod.main([str(tmp_path / "r")]) == 2
    assert "no summary.json" in capsys.readouterr().err
