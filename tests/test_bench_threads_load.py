"""bench/threads_load.py: a small workload quiet and beside a CPU hog, at the thread policy's count and torch's."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("threads_load")


def test_paired_ratios(bench):
    assert bench._paired([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == {"median": 3.0, "min": 2.0, "max": 4.0}


def test_each_arm_runs_at_its_thread_count(bench, capsys):
    """One tiny run end to end: every arm's worker reports the thread count it ran (the policy's, 1, torch's
    default), the hog is started and stopped, and the last line is the JSON with every arm's ratios."""
    from k3post.threads import plan_threads, seen_cores

    assert bench.main(["--workload", "decode", "--steps", "1", "--batch", "1", "--seq", "8", "--repeats", "1",
                       "--hog-cores", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["threads"]["policy"] == plan_threads(seen_cores(), {"workload copies": 1}).per_process
    assert out["threads"]["one"] == 1
    assert set(out["arms"]) == {"policy", "torch", "torch_passive", "one"}
    assert out["threads"]["torch_passive"] == out["threads"]["torch"]
    for arm in out["arms"].values():
        assert len(arm["quiet_s"]) == len(arm["loaded_s"]) == 1 and arm["slowdown"]["min"] > 0
    assert out["hog_cores"] == 1 and "loaded_torch_over_policy" in out and "machine" in out
    assert "loaded_torch_over_torch_passive" in out


def test_bad_arguments_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
