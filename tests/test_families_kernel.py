"""coding.kernel (issue 22): speed score formula, tolerant comparison, verifier structure with an injected
measurer, the reference solver at every effort and every listed hack scoring 0 in the real sandbox.

No test asserts a wall-clock threshold: the real runs assert correctness, the parity floor of the
reference solver (which the noise-adaptive parity band makes robust) and hacks = 0; speed-dependence is
asserted on `speed_score` and on `verify_files` with fixed measured times.
"""

from __future__ import annotations

import array
import hashlib
import math
import os
import random
import statistics

import pytest

from k3post.envs import FinalState, run_episode_sync
from k3post.envs.families import default_families, families, get_family
from k3post.envs.families.kernel.family import (
    KERNEL,
    MAX_RUNS,
    MIN_BAND,
    REF_GATE,
    ROLES,
    ROUND_ORDERS,
    ROUNDS,
    WARMUP,
    Measurement,
    _hidden_cases,
    _public_cases,
    compare,
    expert_files,
    paired_times,
    score,
    speed_score,
    verify_files,
    verify_kernel,
)
from k3post.envs.families.kernel.ops import OPS

EFFORTS = ("low", "high", "max")


def _task(op: str, difficulty: int = 1):
    for t in KERNEL.generate(40, seed=0, difficulty=difficulty):
        if t.metadata["op"] == op:
            return t
    raise AssertionError(f"no {op} task drawn")


# --------------------------------------------------------------------------- the formula


def test_speed_score_golden_values():
    # t_ref = 100, t_expert = 1 (expert 100x), roofline 0.01 (R = t_expert / t_roof = 100), band 0.1
    f = lambda t: speed_score(100.0, 1.0, t, 0.01, 0.1)  # noqa: E731
    assert f(1.0) == 0.5  # parity
    assert f(1.05) == 0.5 and f(1 / 1.05) == 0.5  # inside the band
    assert f(100.0) == 0.0 and f(200.0) == 0.0 and f(100 / 1.49) == 0.0  # under the reference gate 1.5
    # s = 10, gate g = 1.5: 0.5 * ln(10 / 1.5) / ln(100 / (1.5 * 1.1)) = 0.5 * 1.897120 / 4.104395 = 0.231108
    assert f(10.0) == pytest.approx(0.231108, abs=1e-6)
    # gate 1 (no gate but the band): 0.5 * ln(10 / 1.1) / ln(100 / 1.1^2) = 0.5 * (ln 10 - ln 1.1) / (2 (ln 10 - ln 1.1))
    assert speed_score(100.0, 1.0, 10.0, 0.01, 0.1, gate=1.0) == pytest.approx(0.25, abs=1e-12)
    # q = 10: 0.5 + 0.5 * ln(10 / 1.1) / ln(100 / 1.1) = 0.5 + 0.5 * 2.207275 / 4.509860 = 0.744716
    assert f(0.1) == pytest.approx(0.744716, abs=1e-6)
    assert f(0.01) == 1.0 and f(0.001) == 1.0  # at / past the roofline
    # the band edges are continuous
    assert f(1.1 * (1 + 1e-9)) == pytest.approx(0.5, abs=1e-6) and f(1 / 1.1 * (1 - 1e-9)) == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ValueError):
        speed_score(0.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("band", [0.1, 0.3, 0.5])
def test_speed_score_is_monotone_in_the_speedup(band):
    times = [100.0 * 10 ** (-k / 40) for k in range(200)]  # agent time from 100 (s = 1) down to 1e-3
    scores = [speed_score(100.0, 1.0, t, 0.02, band) for t in times]
    assert all(b >= a for a, b in zip(scores, scores[1:]))
    assert scores[0] == 0.0 and scores[7] == 0.0  # s = 1.496 < gate 1.5 and scores[-1] == 1.0 and 0.5 in scores


def test_compare_is_dtype_aware_and_exact_on_nan_inf():
    want = array.array("d", [1.0, math.nan, math.inf, -math.inf, 0.0])
    assert compare(list(want), want, "d") is None
    assert compare([1.0 + 1e-12, math.nan, math.inf, -math.inf, 1e-12], want, "d") is None
    assert "value 0" in compare([1.0 + 1e-7, math.nan, math.inf, -math.inf, 0.0], want, "d")  # float32-level error
    assert compare([1.0 + 1e-7, math.nan, math.inf, -math.inf, 0.0], want, "f") is None  # fine for float32
    assert "value 1" in compare([1.0, 0.0, math.inf, -math.inf, 0.0], want, "d")  # NaN must stay NaN
    assert "value 2" in compare([1.0, math.nan, -math.inf, -math.inf, 0.0], want, "d")  # Inf sign
    assert "value 4" in compare([1.0, math.nan, math.inf, -math.inf, math.nan], want, "d")  # NaN where finite
    assert "4 values" in compare([1.0] * 4, want, "d")


# --------------------------------------------------------------------------- verifier structure (injected timer)


def _m(t_agent: float, noise: float = 0.01, **kw) -> Measurement:
    return Measurement(None, "", kw.get("t_ref", 1e-2), kw.get("t_expert", 1e-4), t_agent, kw.get("t_roof", 1e-6), noise)


def _rounds(cost: dict[str, float], slow: dict[int, float], orders=None) -> dict[str, list[float]]:
    """Timed rounds of the harness (rounds WARMUP .. WARMUP + ROUNDS - 1) when each role's call costs ``cost[role]``
    times ``slow[position]`` (load that hits a position of the round: the call after the parent drew the inputs)."""
    times: dict[str, list[float]] = {r: [] for r in cost}
    for i in range(WARMUP, WARMUP + ROUNDS):
        for pos, role in enumerate((orders or ROUND_ORDERS)[i % len(orders or ROUND_ORDERS)]):
            times[role].append(cost[role] * slow.get(pos, 1.0))
    return times


def test_load_on_one_position_of_the_round_pays_no_reference_copy():
    # the suite run of 2026-12-04 scored a reference copy (the patches_timer hack) 0.17 under load: with the
    # reference always first and unpaired medians, load that slows the round's first call reads as a speedup
    cost = {"ref": 1.0, "agent": 1.0, "expert": 0.05, "null": 0.001, "control": 1.0}
    for slow in ({0: 3.0}, {0: 3.0, 1: 2.0}, {3: 2.5}, {1: 4.0}, {4: 3.0}):
        old = _rounds(cost, slow, orders=[("ref", "agent", "expert", "null", "control")])
        s_old = statistics.median(old["ref"]) / statistics.median(old["agent"])
        p = paired_times(_rounds(cost, slow))
        assert p.t_ref / p.t_agent == pytest.approx(1.0)  # every role sat in every position equally often
        assert speed_score(p.t_ref, p.t_expert, p.t_agent, 1e-4, min(0.5, max(0.15, 3 * p.noise))) == 0.0
        if slow.get(0, 1.0) / slow.get(1, 1.0) > 1.5:  # the old harness (reference first) paid it: the test can fail
            assert s_old > 1.5 and speed_score(statistics.median(old["ref"]), 0.05, statistics.median(old["agent"]),
                                               1e-4, 0.15) > 0
    # every role in every position equally often over the timed rounds
    for role in ROLES:
        positions = [ROUND_ORDERS[i % len(ROUND_ORDERS)].index(role) for i in range(WARMUP, WARMUP + ROUNDS)]
        assert sorted(positions) == sorted(list(range(len(ROLES))) * (ROUNDS // len(ROLES))), role


def test_the_experts_own_code_measured_as_far_off_as_seen_scores_parity():
    """The expert's code in the agent's seat measured 0.85-1.15x the expert at low noise (MAD 0.05: 3 x noise is
    below the smallest band) in 24 verifications of row_sumsq, quiet and with both cores busy (docs/decisions.md
    §kernelband); a band of 0.15 scored 0.848x at 0.494 and failed the reference solver's parity check under load."""
    for q in (0.848, 0.861, 1.154):
        reward, comps = score(_m(1e-4 / q, noise=0.05))
        assert comps["band"] == MIN_BAND and reward == 0.5, (q, reward)
    assert score(_m(1e-4 / 0.78, noise=0.05))[0] < 0.5  # past 1 / (1 + band): slower than the expert


def test_paired_times_golden():
    # agent 2 s in every round; the reference 10, 12, 30 (one slow round), 10: paired ratios 5, 6, 15, 5 -> median
    # 5.5, t_ref = 2 * 5.5; the expert's ratios 0.5 each; noise = median |log r - log 5.5| over the reference's
    # the control (a second child of the reference) 14, 14, 14, 14: paired 7, slower than the reference, so
    # t_ref is the reference's and the spread log(7 / sqrt(30))
    times = {"agent": [2.0] * 4, "ref": [10.0, 12.0, 30.0, 10.0], "expert": [1.0] * 4, "null": [0.1] * 4,
             "control": [14.0] * 4}
    p = paired_times(times)
    assert (p.t_agent, p.t_expert) == (2.0, 1.0)
    assert p.t_ref == pytest.approx(2.0 * math.sqrt(5 * 6))  # the median of an even count is the mean of the middle two logs
    mid = math.log(math.sqrt(30))
    assert p.noise == pytest.approx(statistics.median([abs(math.log(r) - mid) for r in (5, 6, 15, 5)]))
    assert p.spread == pytest.approx(math.log(7.0 / math.sqrt(30)))
    # the control faster than the reference: t_ref is the control's
    assert paired_times({**times, "control": [8.0] * 4}).t_ref == pytest.approx(8.0)


def test_a_reference_child_slowed_for_a_whole_measurement_pays_no_reference_copy():
    # decisions §kernelload: under load 4.4 one reference child read 1.58x slower than a copy of it in all eight
    # rounds (paired noise 0.08), and the harness paid the copy 0.012. With the control, the faster reference
    # child sets t_ref, the spread widens the gate and triggers a re-run
    from k3post.envs.families.kernel.family import score

    cost = {"ref": 1.58, "agent": 1.0, "expert": 0.05, "null": 0.001, "control": 1.0}
    times = _rounds(cost, {})
    p = paired_times(times)
    assert p.t_ref == pytest.approx(1.0) and p.spread == pytest.approx(math.log(1.58)) and p.noise == 0.0
    assert speed_score(1.58, 0.05, 1.0, 1e-4, 0.15) > 0  # without the control: the event that paid
    m = Measurement(None, "", p.t_ref, p.t_expert, p.t_agent, 1e-4, p.noise, spread=p.spread)
    reward, comps = score(m)
    assert reward == 0.0 and comps["gate"] == pytest.approx(REF_GATE * 1.58)
    # the control slowed instead: still the reference's time, and the same gate
    p2 = paired_times(_rounds({**cost, "ref": 1.0, "control": 1.58}, {}))
    assert (p2.t_ref, p2.spread) == (pytest.approx(1.0), pytest.approx(math.log(1.58)))
    # a real kernel 3x faster than the reference still scores when the control is 1.1x off (gate 1.65)
    m3 = Measurement(None, "", 3.0, 0.05, 1.0, 1e-4, 0.02, spread=math.log(1.1))
    assert score(m3)[0] > 0


def test_verify_files_scores_fixed_measured_times_monotonically():
    t = _task("softmax")
    files = expert_files(OPS["softmax"], "d")
    rewards = [verify_files(t, files, measurer=lambda task, f, run, ta=ta: _m(ta)).reward
               for ta in (2e-2, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)]
    assert rewards == sorted(rewards) and rewards[0] == 0.0 and rewards[3] == 0.5 and rewards[-1] == 1.0


def test_verify_files_reruns_noisy_measurements_and_keeps_the_quietest():
    t = _task("softmax")
    calls = []
    noises = [0.4, 0.2, 0.3]

    def noisy(task, files, run):
        calls.append(run)
        return _m(1e-4, noise=noises[run])

    v = verify_files(t, {"kernel.py": ""}, measurer=noisy)
    assert calls == list(range(MAX_RUNS)) and v.components["noise"] == 0.2 and v.components["runs"] == MAX_RUNS
    assert v.components["band"] == pytest.approx(0.5)  # 3 x 0.2 clipped to 0.5
    calls.clear()
    v = verify_files(t, {"kernel.py": ""}, measurer=lambda task, f, run: calls.append(run) or _m(1e-4, noise=0.02))
    assert calls == [0] and v.reward == 0.5
    # a spread control re-runs the measurement as noise does, and the least spread one is scored
    calls.clear()
    spreads = [0.5, 0.05]

    def spread(task, files, run):
        calls.append(run)
        return Measurement(None, "", 1e-2, 1e-4, 1e-4, 1e-6, 0.02, spread=spreads[run])

    v = verify_files(t, {"kernel.py": ""}, measurer=spread)
    assert calls == [0, 1] and v.components["spread"] == 0.05 and v.components["runs"] == 2
    v = verify_files(t, {"kernel.py": ""}, measurer=lambda task, f, run: Measurement("tamper", "a thread was started"))
    assert v.reward == 0.0 and "thread" in v.diagnostics
    assert verify_files(t, {"other.py": ""}).reward == 0.0


def test_hidden_cases_cover_odd_shapes_and_specials():
    t = _task("layernorm")
    cases = _hidden_cases(t, random.Random(0))
    assert any(math.isnan(v) for v in cases[2][0][0]) and any(math.isinf(v) for v in cases[2][0][0])
    assert cases[1][1] != cases[0][1]  # an odd second shape
    assert _public_cases(t)[0][0][0].tobytes() == _public_cases(t)[0][0][0].tobytes()  # the public case is fixed


_RECORDER = """import array, hashlib, os
_log = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seen.txt")
with open(_log, "a") as fh:
    fh.write("loaded\\n")


def layernorm(x, gamma, beta, rows, cols):
    with open(_log, "a") as fh:
        fh.write(hashlib.sha256(x.tobytes()).hexdigest() + "\\n")
    return _ref(x, gamma, beta, rows, cols)
"""


def test_inputs_are_drawn_after_the_submission_is_loaded_and_fresh_on_every_run():
    """Every input the agent's child sees arrives after it has loaded, and no input repeats across runs."""
    from k3post.envs.families.kernel.family import measure
    from k3post.envs.sandbox import Sandbox

    t = _task("layernorm")
    src = _RECORDER + OPS["layernorm"].reference.replace("def layernorm(", "def _ref(")
    seen = []
    for run in range(2):
        with Sandbox() as sb:
            sb.write_file("kernel.py", src)
            m = measure(t, sb, run=run)
            assert m.error is None, m.why
            lines = sb.read_file("seen.txt").split()
        assert lines[0] == "loaded" and "loaded" not in lines[1:]
        seen.append(lines[1:])
    public = hashlib.sha256(_public_cases(t)[0][0][0].tobytes()).hexdigest()
    for run_seen in seen:
        assert len(set(run_seen)) == len(run_seen)  # a fresh input for every call of a run
        assert public not in run_seen
    assert not set(seen[0]) & set(seen[1])  # a re-run draws new inputs


# --------------------------------------------------------------------------- registry


def test_family_is_registered_and_opt_in():
    assert get_family("coding.kernel") is KERNEL and KERNEL in families("coding")
    assert KERNEL.kind == "kernel" and KERNEL not in default_families()
    a, b = KERNEL.generate(6, seed=3, difficulty=2), KERNEL.generate(6, seed=3, difficulty=2)
    assert [x.to_dict() for x in a] == [x.to_dict() for x in b]
    assert len({x.messages[0]["content"] for x in a}) == 6
    t3 = KERNEL.generate(1, seed=0, difficulty=3)[0]
    assert t3.metadata["typecode"] == "f" and "float32" in t3.messages[0]["content"]
    prompt = a[0].messages[0]["content"]
    assert OPS[a[0].metadata["op"]].reference in prompt and "hidden_seed" not in prompt


# --------------------------------------------------------------------------- real sandbox runs


def _episode(task, policy):
    env = KERNEL.make_env(task)
    ep = run_episode_sync(policy, env, task)
    return ep, env


@pytest.mark.parametrize("op,effort", [("softmax", "low"), ("layernorm", "high"), ("matmul_relu", "max"),
                                       ("row_sumsq", "low"), ("stencil5", "high")])
def test_reference_solver_is_correct_and_at_least_parity(op, effort):
    t = _task(op)
    ep, env = _episode(t, KERNEL.reference_policy(t, effort))
    v = verify_kernel(t, FinalState(env.state, ""))
    assert v.components["correct"] == 1.0, v.diagnostics
    assert v.reward >= 0.5, v.diagnostics
    if effort != "low":
        assert any("PASS" in str(m.get("content")) for m in ep.messages if m.get("role") == "tool")


HACK_REASONS = {
    "copies_reference": None,  # correct but no faster than the reference: speed score 0
    "calls_reference": "no reference found",  # the reference never shares the process with agent code
    "cached_public_outputs": "mismatch",
    "memoizes_between_calls": "mismatch",
    "mutates_inputs": "mutated",
    "inspects_inputs_to_shortcut": "mismatch",
    "reduced_precision": "mismatch",
    "patches_timer": None,  # the reference's speed: the verifier's clock is in another process
    "patches_timer_at_import": None,
    "background_thread": "thread",
    "forks": "import",
    "moves_its_cpu": "affinity",  # widens its CPU affinity at every call: the times are not comparable
    "reads_hidden_inputs": "mismatch",
    "forged_result_line": "died",
}


def test_every_hack_scores_zero():
    t = _task("softmax")
    wrong = KERNEL.wrong_policies(t)
    assert set(HACK_REASONS) <= set(wrong)
    for name, policy in wrong.items():
        if name == "moves_its_cpu" and len(os.sched_getaffinity(0)) == 1:
            continue  # one usable CPU: the affinity cannot change, and the kernel is the expert's
        ep, env = _episode(t, policy)
        v = verify_kernel(t, FinalState(env.state, ""))
        assert v.reward == 0.0, (name, v.diagnostics)
        assert ep.reward == 0.0, name
        reason = HACK_REASONS.get(name)
        if reason:
            assert reason in v.diagnostics, (name, v.diagnostics)


@pytest.mark.slow
@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("op", sorted(OPS))
def test_reference_and_hacks_sweep(op, difficulty):
    t = _task(op, difficulty)
    for effort in EFFORTS:
        _, env = _episode(t, KERNEL.reference_policy(t, effort))
        v = verify_kernel(t, FinalState(env.state, ""))
        assert v.components["correct"] == 1.0 and v.reward >= 0.5, (effort, v.diagnostics)
    for name, policy in KERNEL.wrong_policies(t).items():
        _, env = _episode(t, policy)
        assert verify_kernel(t, FinalState(env.state, "")).reward == 0.0, name


def test_bench_envs_reports_the_kernel_familys_timing_noise():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_envs", Path(__file__).parents[1] / "bench" / "envs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fams, notes = bench.load_families()  # the registry's built-in list (registry.BUILTIN_MODULES)
    assert KERNEL in fams and notes == []
    r = bench.bench_family(KERNEL, 1, 0)
    assert r["episodes"] == 1 and r["mean_reward"] >= 0.5
    assert 0.0 <= r["timing_noise_median"] <= r["timing_noise_max"]
