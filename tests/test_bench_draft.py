"""bench/draft.py: the core function at a tiny size (seconds) gives the documented JSON keys, the three drafts of
a seed saw identical batches (and two seeds did not), the ratios are the runs' acceptance lengths divided, and
the 95% t-interval is the hand-derived one."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_draft", Path(__file__).parents[1] / "bench" / "draft.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_t_interval_golden():
    # xs = 1, 2, 3: mean 2, sd 1, t_{.975, 2} = 4.303 -> half-width 4.303 / sqrt(3) = 2.4844
    ci = bench.mean_ci95([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["hi"] - 2.0 == pytest.approx(4.303 / math.sqrt(3))
    assert bench.t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)  # Cornish-Fisher vs the table value
    assert bench.t_quantile_975(11) == pytest.approx(2.201, abs=1e-3)


def test_bench_core_tiny(tmp_path):
    args = bench.parser().parse_args(["--sft-steps", "3", "--train-tasks", "3", "--held-tasks", "1", "--draft-steps",
                                      "3", "--seeds", "2", "--gen-tokens", "6", "--repeats", "1", "--speed-grid",
                                      "headline", "--ttt-steps", "2", "--data-tokens", "24", "--batch-size", "2"])
    res = bench.run(args, tmp_path)
    for key in ("lk_over_kl_accept_len_t1", "lk_lambda_over_kl_accept_len_t1", "alpha_by_depth", "spec_decode_speedup",
                "draft_cost_vs_target"):
        assert key in res
    assert set(res["alpha_by_depth"]) == {"kl", "lk_alpha", "lk_lambda"}
    assert all(len(a) == 2 and all(0 < x <= 1 for x in a) for a in res["alpha_by_depth"].values())
    runs = {(r["seed"], r["loss"]): r for r in res["runs"]}
    assert len(runs) == 6
    for s in range(2):
        assert len({runs[s, loss]["data_sha"] for loss in ("kl", "lk_alpha", "lk_lambda")}) == 1
    assert runs[0, "kl"]["data_sha"] != runs[1, "kl"]["data_sha"]  # another seed, another batch order
    assert res["same_data"] is True
    want = [runs[s, "lk_alpha"]["accept_len"]["k5_t1"] / runs[s, "kl"]["accept_len"]["k5_t1"] for s in range(2)]
    assert res["lk_over_kl_accept_len_t1"]["per_seed"] == want
    assert res["lk_over_kl_accept_len_t1"]["mean"] == pytest.approx(sum(want) / 2)
    assert all(1 <= v <= 8 for r in res["runs"] for v in r["accept_len"].values())  # k + 1 at most
    assert res["spec_decode_speedup"] > 0 and res["draft_cost_vs_target"] > 0
    cell = res["speed_grid"]["b1_k3_t1"]
    assert list(res["speed_grid"]) == ["b1_k3_t1"] and cell["speedup"] == res["spec_decode_speedup"]
    assert 1 <= cell["accept_len"] <= 4 and cell["verify_round_over_decode_step"] > 0
    assert bench.table(res).splitlines()[0].startswith("| loss | α0 | α1 |")
