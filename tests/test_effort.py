"""Tests of k3post.rewards.effort: reasoning-effort control (SPEC §3.3, issue 7 part 2).

Hand-derived golden values for the limits, the −1 override and its metrics, the quantile and
the b0 fallbacks (the derivation is in a comment next to each); parity of the quantile with
torch.quantile; the budget table's JSON cache (round trip, corrupt file, frozen b0s); the
curriculum order; and one real estimate with a fresh tiny Qwen3-MoE on general.arithmetic
through the real AgentLoop, where the untrained model is never correct and every b0 falls
back to the family median of all samples.

Shape legend: N samples.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from omegaconf import OmegaConf

from k3post.envs.families.registry import get_family
from k3post.models import build_tiny_moe
from k3post.rewards.effort import (
    BudgetTable,
    Curriculum,
    EffortConfig,
    TaskSamples,
    budget_limit,
    effort_override,
    effort_scale,
    estimate_b0,
    estimate_budgets,
    family_medians,
    group_override,
    is_correct,
    override_rewards,
    quantile,
    task_key,
)
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.trajectory import Group, Trajectory
from k3post.xtml import EOM, XTML


# --------------------------------------------------------------------------- limits and the override


def test_budget_limit_golden():
    cfg = EffortConfig()
    # tau_high = 1.0: 1.0 * 100; tau_low = 0.4: 0.4 * 100; max: min(2.0, cap 4.0) * 100
    assert budget_limit(100, "high", "general", cfg) == pytest.approx(100.0)
    assert budget_limit(100, "low", "general", cfg) == pytest.approx(40.0)
    assert budget_limit(100, "max", "coding", cfg) == pytest.approx(200.0)
    assert budget_limit(0, "max", "coding", cfg) == 0.0
    # a large tau_max is capped: min(5 * 100, 4 * 100) = 400
    assert budget_limit(100, "max", "agents", EffortConfig(tau_max=5.0)) == pytest.approx(400.0)
    # per-domain overrides: coding max 6 -> capped at 4 -> 4 * 10 = 40; agents high 1.5 -> 15;
    # general keeps the global taus (max 2 -> 20, high 1 -> 10)
    cfg = EffortConfig(domain_tau={"coding": {"max": 6.0}, "agents": {"high": 1.5}})
    assert budget_limit(10, "max", "coding", cfg) == pytest.approx(40.0)
    assert budget_limit(10, "high", "agents", cfg) == pytest.approx(15.0)
    assert budget_limit(10, "max", "general", cfg) == pytest.approx(20.0)
    assert budget_limit(10, "high", "general", cfg) == pytest.approx(10.0)
    assert budget_limit(10, "high", "coding", cfg) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="b0"):
        budget_limit(-1, "max", "general", cfg)
    with pytest.raises(ValueError, match="effort"):
        budget_limit(10, "medium", "general", cfg)
    with pytest.raises(ValueError, match="domain"):
        budget_limit(10, "max", "math", cfg)


def test_effort_override_golden_high():
    # high, tau 1.0, b0 = 20 for all: limit 20.
    #   T = 10 <= 20 keep 1;  30 > 20 -> -1;  21 > 20 -> -1;  20 is not > 20, keep 0.5
    # violation rate 2/4 = 0.5; mean T = (10 + 30 + 21 + 20) / 4 = 81 / 4 = 20.25;
    # mean T/b0 = (0.5 + 1.5 + 1.05 + 1.0) / 4 = 4.05 / 4 = 1.0125
    r_N, m = effort_override([1.0, 0.0, 1.0, 0.5], [10, 30, 21, 20], [20, 20, 20, 20], "high", "general", EffortConfig())
    assert r_N.tolist() == [1.0, -1.0, -1.0, 0.5]
    assert m["violation_rate"] == pytest.approx(0.5)
    assert m["mean_tokens"] == pytest.approx(20.25)
    assert m["mean_ratio"] == pytest.approx(1.0125)


def test_effort_override_golden_low_per_sample_b0():
    # low, tau 0.4, b0 = [10, 25, 5]: limits [4, 10, 2]; T = [4, 11, 2]:
    #   4 > 4 no, 11 > 10 yes, 2 > 2 no -> rewards [1, -1, 0]
    # violation 1/3; mean T = 17/3; mean T/b0 = (0.4 + 0.44 + 0.4) / 3 = 1.24 / 3
    r_N, m = effort_override(torch.tensor([1.0, 1.0, 0.0]), [4, 11, 2], [10.0, 25.0, 5.0], "low", "agents", EffortConfig())
    assert r_N.dtype == torch.float32 and r_N.tolist() == [1.0, -1.0, 0.0]
    assert m["violation_rate"] == pytest.approx(1 / 3)
    assert m["mean_tokens"] == pytest.approx(17 / 3)
    assert m["mean_ratio"] == pytest.approx(1.24 / 3)


def test_effort_override_golden_max_and_cap():
    # max, default: scale min(2, 4) = 2, b0 10 -> limit 20: T 20 keeps 0.7, T 21 -> -1
    r_N, m = effort_override([0.7, 1.0], [20, 21], [10, 10], "max", "general", EffortConfig())
    assert r_N.tolist() == pytest.approx([0.7, -1.0])
    # coding max tau 6 capped at 4 -> limit 40: 39 and 40 kept, 41 -> -1; violation 1/3
    cfg = EffortConfig(domain_tau={"coding": {"max": 6.0}})
    r_N, m = effort_override([1.0, 1.0, 1.0], [39, 40, 41], [10, 10, 10], "max", "coding", cfg)
    assert r_N.tolist() == [1.0, 1.0, -1.0] and m["violation_rate"] == pytest.approx(1 / 3)
    # the same samples in general (scale 2, limit 20) are all over
    r_N, _ = effort_override([1.0, 1.0, 1.0], [39, 40, 41], [10, 10, 10], "max", "general", cfg)
    assert r_N.tolist() == [-1.0, -1.0, -1.0]


def test_override_rewards_validation():
    ok = torch.ones(2)
    with pytest.raises(ValueError, match="1-D of one length"):
        override_rewards(ok, torch.ones(3), torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="b0"):
        override_rewards(ok, ok, torch.tensor([1.0, 0.0]), 1.0)
    with pytest.raises(ValueError, match="token counts"):
        override_rewards(ok, torch.tensor([1.0, -2.0]), ok, 1.0)
    with pytest.raises(ValueError, match="no samples"):
        override_rewards(torch.ones(0), torch.ones(0), torch.ones(0), 1.0)


def test_group_override_counts_output_tokens_for_agents():
    task = get_family("agents.search").generate(1, seed=0)[0]
    table = BudgetTable()
    table.add_samples({task_key(task): TaskSamples(task.family, [100], [True])}, q=0.9, min_b0=1.0)
    assert table.b0(task) == 100.0  # the 0.9-quantile of one value is that value

    def traj(j: int, out: int, think: int, reward: float) -> Trajectory:
        return Trajectory(
            traj_id=f"g0/s{j}", group_id=0, sample_index=j, seed=j, task=task.to_dict(), status="done",
            reward=reward, domain="agents", output_tokens=out, thinking_tokens=think,
        )

    # high, limit 1.0 * 100; agents count output tokens: 90 keep 1, 101 -> -1, 150 -> -1
    # (counting thinking tokens 200 / 10 / 10 would have given [-1, 1, 0] instead)
    group = Group(0, task.to_dict(), [traj(0, 90, 200, 1.0), traj(1, 101, 10, 1.0), traj(2, 150, 10, 0.0)])
    r_N, m = group_override(group, table, "high", EffortConfig(reference_floor=False))
    assert r_N.tolist() == [1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="no budget floor at high"):  # the floor is on by default, never computed
        group_override(group, table, "high", EffortConfig())
    assert m["mean_tokens"] == pytest.approx((90 + 101 + 150) / 3)
    other = get_family("agents.search").generate(2, seed=0)[1]
    with pytest.raises(ValueError, match="no b0"):
        table.b0(other)


def test_budget_floor_golden():
    cfg = EffortConfig()
    # low: 0.4 * 262 = 104.8 < floor 263 -> 263; high: 262 > 200 -> 262; without the floor: 104.8
    assert budget_limit(262.0, "low", "agents", cfg, floor=263.0) == 263.0
    assert budget_limit(262.0, "high", "agents", cfg, floor=200.0) == 262.0
    assert budget_limit(262.0, "low", "agents", EffortConfig(reference_floor=False), floor=263.0) == pytest.approx(104.8)
    # max keeps τ_max · b0 (min(2, cap 4) · 142 = 284) under a longer max reference: the floor bounds reduced efforts only
    assert budget_limit(142.0, "max", "coding", cfg, floor=618.0) == 284.0
    from k3post.rewards.effort import floor_applies

    assert [floor_applies(e, cfg) for e in ("low", "high", "max")] == [True, True, False]
    assert not floor_applies("low", EffortConfig(reference_floor=False))
    # T 263 at the floor keeps its reward, 264 is over; the floor of the second sample is below 0.4 * b0
    r_N, m = override_rewards(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([263, 264, 50]),
                              torch.tensor([262.0, 262.0, 100.0]), 0.4, torch.tensor([263.0, 263.0, 10.0]))
    assert r_N.tolist() == [1.0, -1.0, -1.0] and m["violation_rate"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="floors"):
        override_rewards(torch.tensor([1.0]), torch.tensor([1]), torch.tensor([1.0]), 0.4, torch.tensor([1.0, 2.0]))


def test_reference_floor_keeps_the_reference_solution_inside_its_effort_budget(xtml_tokenizer):
    """The demo's agents.low collapsed (0.125 -> 0): its SFT model's correct answers are the family's low-effort
    reference, T 259-269, and b0 (their 0.9-quantile) times τ_low = 0.4 put every one of them at -1. With the floor,
    a sample as long as the reference keeps its reward at low effort; one token longer does not. At high effort the
    floor is the high reference's T (agents.high fell 0.156 -> 0.031 with a limit of b0 under it)."""
    from k3post.rollout.evaluation import reference_effort_tokens

    xtml = XTML(xtml_tokenizer)
    task = get_family("agents.search").generate(1, seed=0)[0]
    floor = reference_effort_tokens(xtml, task, "low")
    assert floor is not None and floor > 0
    high = reference_effort_tokens(xtml, task, "high")
    assert high is not None and high > floor  # the high reference adds its reasoning to the same calls
    table = BudgetTable()
    table.add_samples({task_key(task): TaskSamples(task.family, [floor] * 4, [True] * 4)}, q=0.9, min_b0=1.0)

    def traj(j: int, out: int) -> Trajectory:
        return Trajectory(traj_id=f"g0/s{j}", group_id=0, sample_index=j, seed=j, task=task.to_dict(), status="done",
                          reward=1.0, domain="agents", output_tokens=out, thinking_tokens=0)

    group = Group(0, task.to_dict(), [traj(0, floor), traj(1, floor + 1)])
    off, _ = group_override(group, table, "low", EffortConfig(reference_floor=False))
    assert off.tolist() == [-1.0, -1.0]  # 0.4 * b0 < floor: no correct answer fits
    from k3post.rewards.effort import add_floors

    assert add_floors(table, [task], lambda t, e: reference_effort_tokens(xtml, t, e), ["low"]) == 1
    assert table.floor(task, "low") == floor and add_floors(table, [task], lambda t, e: 1 / 0, ["low"]) == 0  # once
    with pytest.raises(ValueError, match="no budget floor at high"):
        table.floor(task, "high")
    on, _ = group_override(group, table, "low", EffortConfig())
    assert on.tolist() == [1.0, -1.0]
    assert add_floors(table, [task], lambda t, e: reference_effort_tokens(xtml, t, e)) == 2  # high and max
    assert table.floor(task, "high") == high
    at_high = Group(0, task.to_dict(), [traj(0, high), traj(1, high + 1)])
    assert group_override(at_high, table, "high", EffortConfig())[0].tolist() == [1.0, -1.0]
    assert group_override(at_high, table, "high", EffortConfig(reference_floor=False))[0].tolist() == [-1.0, -1.0]
    # a general task's T counts thinking only: the low-effort arithmetic reference does not think
    arith = get_family("general.arithmetic").generate(1, seed=0)[0]
    assert reference_effort_tokens(xtml, arith, "low") == 0 < reference_effort_tokens(xtml, arith, "max")


def test_budget_table_floor_round_trip_and_bad_floor(tmp_path):
    table = BudgetTable({"effort": "max"})
    table.add_samples({"k": TaskSamples("agents.search", [10, 20], [True, False])}, q=0.9, min_b0=1.0)
    table.entries["k"].floors = {"low": 263.0, "high": 309.0}
    again = BudgetTable.load(table.save(tmp_path / "b.json"))
    assert (again.floor("k", "low"), again.floor("k", "high")) == (263.0, 309.0) and again.b0("k") == table.b0("k")
    for bad in ({"low": -1}, {"medium": 3}, {"low": True}, [263]):
        data = table.to_dict()
        data["entries"]["k"]["floors"] = bad
        with pytest.raises(ValueError, match="floors"):
            BudgetTable.from_dict(data)
    table.add_samples({"j": TaskSamples("agents.search", [10], [True])}, q=0.9, min_b0=1.0, floor=0.0)
    assert [table.floor("j", e) for e in ("low", "high", "max")] == [0.0, 0.0, 0.0]  # given by hand, every effort


# --------------------------------------------------------------------------- the estimator


def test_estimate_budgets_adds_floors_to_a_cached_table_without_the_model(xtml_tokenizer, tmp_path):
    tasks = get_family("agents.search").generate(2, seed=0)
    settings = {"effort": "max", "samples_per_task": 2, "seed": 0, "max_tokens": 8, "quantile": 0.9, "min_b0": 1.0,
                "correct_reward": 1.0}
    table = BudgetTable(settings)
    table.add_samples({task_key(t): TaskSamples(t.family, [5, 6], [True, True]) for t in tasks}, q=0.9, min_b0=1.0)
    path = table.save(tmp_path / "b0.json")
    seen = []
    got = estimate_budgets(None, tasks, xtml=XTML(xtml_tokenizer), samples_per_task=2, seed=0, max_tokens=8, path=path,
                           floor=lambda t, e: seen.append((t.id, e)) or 100 + len(seen))  # no engine: nothing sampled
    assert seen == [(t.id, e) for t in tasks for e in ("low", "high", "max")]
    assert [got.floor(t, "high") for t in tasks] == [102.0, 105.0]
    assert [BudgetTable.load(path).floor(t, "max") for t in tasks] == [103.0, 106.0]  # saved back


def test_quantile_golden():
    # sorted [10, 20, 30, 40]; q 0.9: h = 3 * 0.9 = 2.7 -> 30 + 0.7 * (40 - 30) = 37
    assert quantile([40, 10, 30, 20], 0.9) == pytest.approx(37.0)
    # median: h = 1.5 -> 20 + 0.5 * 10 = 25
    assert quantile([40, 10, 30, 20], 0.5) == pytest.approx(25.0)
    assert quantile([40, 10, 30, 20], 1.0) == 40.0 and quantile([40, 10, 30, 20], 0.0) == 10.0
    assert quantile([7], 0.9) == 7.0
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match="q must be"):
        quantile([1], 1.5)


def test_quantile_matches_torch_quantile():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        xs = [rng.randint(0, 500) for _ in range(n)]
        q = rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()])
        want = float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q, interpolation="linear"))
        assert quantile(xs, q) == pytest.approx(want, abs=1e-9)


def test_estimate_b0_golden_and_fallbacks():
    # sorted [8, 12, 20, 31, 50], h = 4 * 0.9 = 3.6 -> 31 + 0.6 * (50 - 31) = 42.4
    assert estimate_b0([12, 50, 31, 20, 8], 17.5) == pytest.approx(42.4)
    assert estimate_b0([], 17.5) == 17.5  # no correct sample: the family median
    assert estimate_b0([0, 0], None) == 1.0  # floor min_b0 = 1 token
    assert estimate_b0([0, 0], None, min_b0=3.0) == 3.0
    assert estimate_b0([10, 30], None, q=0.5) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="no correct sample and no family median"):
        estimate_b0([], None)


def _table_samples() -> dict[str, TaskSamples]:
    return {
        "a1": TaskSamples("A", [10, 20, 30, 40], [True, False, True, False]),
        "a2": TaskSamples("A", [5, 15], [False, False]),
        "a3": TaskSamples("A", [50, 60], [True, False]),
        "b1": TaskSamples("B", [3, 9], [False, False]),
        "b2": TaskSamples("B", [6, 100, 12], [False, False, False]),
    }


def test_budget_table_fallbacks_golden():
    table = BudgetTable({"effort": "max"})
    table.add_samples(_table_samples(), q=0.9, min_b0=1.0)
    # a1: its correct [10, 30], h = 0.9 -> 10 + 0.9 * 20 = 28
    # a3: its correct [50] -> 50
    # a2: none correct -> median of A's correct samples [10, 30, 50] = 30
    # B: no correct sample at all -> median of all B samples, sorted [3, 6, 9, 12, 100] -> 9
    assert table.b0("a1") == pytest.approx(28.0) and table.entries["a1"].source == "correct"
    assert table.b0("a3") == 50.0
    assert table.b0("a2") == 30.0 and table.entries["a2"].source == "family_correct"
    assert table.b0("b1") == table.b0("b2") == 9.0 and table.entries["b2"].source == "family_all"
    assert family_medians(_table_samples().values()) == {"A": (30.0, "family_correct"), "B": (9.0, "family_all")}
    # later tasks: A's correct samples become [10, 30, 50, 200], median h = 1.5 -> 30 + 0.5 * 20 = 40
    # for the new a5; a2 keeps its b0 of 30 (estimated once)
    table.add_samples({"a4": TaskSamples("A", [200], [True]), "a5": TaskSamples("A", [1], [False]),
                       "a1": TaskSamples("A", [999], [True])}, q=0.9, min_b0=1.0)
    assert table.b0("a5") == 40.0 and table.b0("a2") == 30.0 and table.b0("a4") == 200.0
    assert table.b0("a1") == pytest.approx(28.0)  # already estimated: the new samples are ignored
    assert len(table) == 7


def test_budget_table_cache_round_trip_and_corrupt_file(tmp_path):
    table = BudgetTable({"effort": "max", "samples_per_task": 2})
    table.add_samples(_table_samples(), q=0.9, min_b0=1.0)
    path = table.save(tmp_path / "sub" / "b0.json")
    assert [p.name for p in path.parent.iterdir()] == ["b0.json"]  # no temporary file left
    back = BudgetTable.load(path)
    assert back.to_dict() == table.to_dict() and back.settings == table.settings
    assert back.b0("a1") == pytest.approx(28.0) and back.entries["b2"].samples.tokens == [6, 100, 12]
    path.write_text('{"version": 1, "settings": {}, "entr')
    with pytest.raises(ValueError, match=r"b0\.json: corrupt budget table"):
        BudgetTable.load(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match=r"b0\.json: corrupt budget table"):
        BudgetTable.load(path)
    bad = table.to_dict()
    bad["entries"]["a1"]["b0"] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"b0\.json: corrupt budget table"):
        BudgetTable.load(path)
    with pytest.raises(ValueError, match="no budget table file"):
        BudgetTable.load(tmp_path / "missing.json")


def test_is_correct_needs_a_verdict_and_the_reward():
    task = get_family("general.arithmetic").generate(1, seed=0)[0]

    def traj(reward: float, verdict: bool, status: str = "done") -> Trajectory:
        return Trajectory(traj_id="g0/s0", group_id=0, sample_index=0, seed=0, task=task.to_dict(), status=status,
                          reward=reward, verdict={"reward": reward, "components": {}, "diagnostics": ""} if verdict else None)

    assert is_correct(traj(1.0, True))
    assert not is_correct(traj(1.0, False))  # no verdict: cut by length / context / malformed
    assert not is_correct(traj(0.5, True)) and is_correct(traj(0.5, True), correct_reward=0.5)
    assert not is_correct(traj(1.0, True, status="paused"))


def test_task_key_is_the_content_hash():
    a, b = get_family("general.arithmetic").generate(2, seed=0)
    assert task_key(a) == a.content_hash() == task_key(type(a).from_dict(a.to_dict()))
    assert task_key(a) != task_key(b)


# --------------------------------------------------------------------------- config and curriculum


def test_effort_config_defaults_validation_and_omegaconf():
    cfg = EffortConfig()
    assert (cfg.tau_max, cfg.tau_high, cfg.tau_low, cfg.max_cap) == (2.0, 1.0, 0.4, 4.0)
    assert (cfg.b0_samples, cfg.b0_quantile, cfg.curriculum) == (4, 0.9, ["max", "high", "low"])
    assert effort_scale("max", "general", cfg) == 2.0
    for kw, match in [
        ({"tau_low": 0.0}, "tau_low"),
        ({"max_cap": -1.0}, "max_cap"),
        ({"domain_tau": {"math": {"max": 1.0}}}, "unknown domain 'math'"),
        ({"domain_tau": {"coding": {"medium": 1.0}}}, "unknown effort 'medium'"),
        ({"domain_tau": {"coding": {"low": 0.0}}}, "domain_tau.coding.low"),
        ({"b0_samples": 0}, "b0_samples"),
        ({"b0_quantile": 1.5}, "b0_quantile"),
        ({"curriculum": ["max", "max"]}, "curriculum"),
        ({"curriculum": []}, "curriculum"),
    ]:
        with pytest.raises(ValueError, match=match):
            EffortConfig(**kw)
    merged = OmegaConf.merge(OmegaConf.structured(EffortConfig), {"domain_tau": {"coding": {"max": 3.0}}, "tau_low": 0.5})
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, EffortConfig) and obj.domain_tau == {"coding": {"max": 3.0}} and obj.tau_low == 0.5


def test_curriculum_max_high_low_each_from_the_previous_expert():
    stages = list(Curriculum(["general", "coding"], EffortConfig(), init="runs/x/sft"))
    assert [(s.domain, s.effort, s.init_from, s.expert) for s in stages] == [
        ("general", "max", "runs/x/sft", "general.max"),
        ("general", "high", "general.max", "general.high"),
        ("general", "low", "general.high", "general.low"),
        ("coding", "max", "runs/x/sft", "coding.max"),
        ("coding", "high", "coding.max", "coding.high"),
        ("coding", "low", "coding.high", "coding.low"),
    ]
    assert [s.scale for s in stages[:3]] == [2.0, 1.0, 0.4]
    cfg = EffortConfig(tau_max=9.0, domain_tau={"coding": {"low": 0.2}})
    assert [s.scale for s in Curriculum(["coding"], cfg)] == [4.0, 1.0, 0.2]  # max capped at 4
    with pytest.raises(ValueError, match="domains"):
        Curriculum(["general", "general"], EffortConfig())
    with pytest.raises(ValueError, match="domains"):
        Curriculum(["math"], EffortConfig())


# --------------------------------------------------------------------------- a real estimate


@pytest.mark.usefixtures("one_torch_thread")
def test_estimate_budgets_untrained_model_falls_back_to_family_median(xtml_tokenizer, tmp_path):
    tok = xtml_tokenizer
    xtml = XTML(tok)
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM)).eval()
    tasks = get_family("general.arithmetic").generate(3, seed=0)
    path = tmp_path / "b0.json"
    kw = dict(xtml=xtml, samples_per_task=3, seed=5, max_tokens=16, path=path)
    engine = EmbeddedEngine(model, tok, max_batch_size=9)
    table = estimate_budgets(engine, tasks, **kw)
    assert path.is_file() and len(table) == 3 and table.settings["effort"] == "max"
    every = []
    for t in tasks:
        e = table.entries[task_key(t)]
        assert e.samples.family == "general.arithmetic" and e.samples.correct == [False] * 3
        assert all(0 <= n <= 16 for n in e.samples.tokens)
        every += e.samples.tokens
    # never correct -> every b0 is the median of all 9 samples of the family (at least 1 token)
    want = max(1.0, float(torch.quantile(torch.tensor(every, dtype=torch.float64), 0.5)))
    assert all(table.b0(t) == pytest.approx(want) and table.entries[task_key(t)].source == "family_all" for t in tasks)
    assert table.medians["general.arithmetic"] == (pytest.approx(want), "family_all")
    assert table.b0s(tasks).tolist() == pytest.approx([want] * 3)

    # an independent replay through the AgentLoop (effort "max", the same seeds) gives the
    # same T(y) = thinking tokens (general domain), some of them cut short by a sampled
    # <|close|>, and its prompts carry the thinking-effort message
    replay_engine = EmbeddedEngine(model, tok, max_batch_size=9)
    loop = AgentLoop(replay_engine, xtml, lambda task: get_family(task.family).make_env(task),
                     sampling=SamplingParams(temperature=1.0, max_tokens=16), effort="max")
    for task in tasks:
        g = int(task_key(task)[:12], 16)
        trajs = loop.run([
            Trajectory(traj_id=f"g{g}/s{j}", group_id=g, sample_index=j, seed=trajectory_seed(5, g, j), task=task.to_dict())
            for j in range(3)
        ])
        assert [t.thinking_tokens for t in trajs] == table.entries[task_key(task)].samples.tokens
        assert all(t.effort_tokens() == t.thinking_tokens and t.reward == 0.0 for t in trajs)
        assert "thinking_effort=max" in tok.decode(trajs[0].token_ids[: trajs[0].prompt_len])
    assert min(every) < 16

    # cached: the same call runs nothing
    stats = dict(engine.stats)
    again = estimate_budgets(engine, tasks, **kw)
    assert engine.stats == stats and again.to_dict() == table.to_dict()
    # one new task: only its 3 samples run, the old b0s are kept
    more = get_family("general.arithmetic").generate(4, seed=0)
    bigger = estimate_budgets(engine, more, **kw)
    assert len(bigger) == 4 and 0 < engine.stats["decode_tokens"] - stats["decode_tokens"] <= 3 * 16
    assert all(bigger.b0(t) == table.b0(t) for t in tasks)
    # other settings against the same file: an error naming it
    with pytest.raises(ValueError, match=r"b0\.json: budget table estimated with"):
        estimate_budgets(engine, tasks, **{**kw, "samples_per_task": 2})
    # another temperature (the RL rollouts'): recorded, a conflict with the temperature-1 table, and the samples
    # are the AgentLoop's at that temperature
    with pytest.raises(ValueError, match=r"b0\.json: budget table estimated with"):
        estimate_budgets(engine, tasks, **{**kw, "temperature": 0.5})
    cold = estimate_budgets(EmbeddedEngine(model, tok, max_batch_size=9), tasks,
                            **{**kw, "temperature": 0.5, "path": tmp_path / "b0_t05.json"})
    assert cold.settings["temperature"] == 0.5 and "temperature" not in table.settings
    changed = 0
    for task in tasks:
        g = int(task_key(task)[:12], 16)
        runs = {}
        for temp in (0.5, 1.0):
            loop = AgentLoop(EmbeddedEngine(model, tok, max_batch_size=9), xtml,
                             lambda task: get_family(task.family).make_env(task),
                             sampling=SamplingParams(temperature=temp, max_tokens=16), effort="max")
            runs[temp] = loop.run([
                Trajectory(traj_id=f"g{g}/s{j}", group_id=g, sample_index=j, seed=trajectory_seed(5, g, j),
                           task=task.to_dict())
                for j in range(3)
            ])
        assert [t.thinking_tokens for t in runs[0.5]] == cold.entries[task_key(task)].samples.tokens
        changed += [t.token_ids for t in runs[0.5]] != [t.token_ids for t in runs[1.0]]
    assert changed  # the two temperatures sample differently: the check above can fail
    with pytest.raises(ValueError, match="temperature"):
        estimate_budgets(engine, tasks, **{**kw, "temperature": -1.0, "path": None})


@pytest.mark.parametrize("family,effort", [("agents.search", "low"), ("agents.search", "high"),
                                           ("coding.write_function", "low"), ("general.arithmetic", "max"),
                                           ("general.arithmetic", "high")])
def test_reference_floor_is_the_t_a_rollout_of_the_reference_counts(xtml_tokenizer, family, effort):
    """The floor is what the budget check will count: a policy that samples exactly the reference's assistant tokens
    through the real AgentLoop (a scripted engine; the loop renders its own prompts, runs the environment, counts
    T with `Trajectory.effort_tokens`) gets reward 1 and T equal to `reference_effort_tokens`."""
    from scripted_engine import ScriptedEngine

    from k3post.envs.episode import run_episode_sync
    from k3post.rollout.evaluation import local_env, reference_effort_tokens, run_episodes

    xtml = XTML(xtml_tokenizer)
    fam = get_family(family)
    task = fam.generate(1, seed=0)[0]
    ep = run_episode_sync(fam.reference_policy(task, effort), local_env(task), task)
    r = xtml.render(ep.messages, tools=ep.tools or None, effort=effort, mode="think")
    ids, mask = list(r.ids), list(r.loss_mask)
    turns = {}  # start of each assistant turn -> its end (the loss mask's runs)
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            turns[i] = j

    def script(req):  # the prompt must be the reference's context up to the turn: the loop renders as SFT did
        n = len(req.prompt_ids)
        assert n in turns and list(req.prompt_ids) == ids[:n], (n, sorted(turns))
        return ids[n:turns[n]]

    traj = run_episodes(ScriptedEngine(script, eom_id=xtml.eom_id), xtml, [task], effort=effort, max_tokens=4096)[0][0]
    assert traj.reward == 1.0 and traj.effort_tokens() == reference_effort_tokens(xtml, task, effort) > 0


def test_budget_summary_golden_and_the_report_prints_it(tmp_path):
    """Three agents tasks: b0 100 / 200 / 300, floors at low 150 / 50 / 130 (0.4·b0 = 40 / 80 / 120): limits 150,
    80, 130 -> median 130, two raised by the floor; at high (τ 1) floors 0 -> limits = b0, none raised."""
    from k3post.recipes.report import _rl_section
    from k3post.rewards.effort import budget_summary

    table = BudgetTable()
    for key, b0, low in (("a", 100, 150.0), ("b", 200, 50.0), ("c", 300, 130.0)):
        table.add_samples({key: TaskSamples("agents.search", [b0], [True])}, q=0.9, min_b0=1.0)
        table.entries[key].floors = {"low": low, "high": 0.0, "max": 0.0}
    s = budget_summary(table, "agents", EffortConfig())
    assert s["tasks"] == 3 and s["median_b0"] == 200.0
    assert s["efforts"]["low"] == {"median_limit": 130.0, "median_floor": 130.0, "raised_by_floor": 2}
    assert s["efforts"]["high"] == {"median_limit": 200.0, "median_floor": 0.0, "raised_by_floor": 0}
    assert s["efforts"]["max"]["median_limit"] == 400.0  # min(τ_max 2, cap 4) · b0
    off = budget_summary(table, "agents", EffortConfig(reference_floor=False))
    assert off["efforts"]["low"]["median_limit"] == 80.0 and off["efforts"]["low"]["raised_by_floor"] == 0
    expert = {"domain": "agents", "effort": "low", "sft_pass_rate": 0.1, "pass_rate": 0.2, "n": 32,
              "sft_mean_effort_tokens": 250.0, "mean_effort_tokens": 240.0, "final_violation_rate": 0.0, "steps": 16,
              "seconds": 60.0, "reward_curve": [0.1, 0.2], "eval": {"overall": {"effort_tokens": [240, 240]}}}
    html = _rl_section(tmp_path, {"experts": {"experts": {"agents.low": expert}, "budgets": {"agents": s}}})
    assert "low: median limit (raised by the floor)" in html and "130 (2/3)" in html
