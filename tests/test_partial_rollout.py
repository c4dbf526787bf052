"""Tests of partial rollout (SPEC §3.2): k3post.rollout.scheduler and k3post.rollout.kv_pool.

Real engine (a fresh tiny Qwen3-MoE), real ``general.arithmetic`` environments. Heavy-tailed
lengths come from per-trajectory max_tokens drawn from a Pareto distribution with
``ignore_eos`` (so a trajectory's length is known and long ones span many iterations).
Checks: λ = 1 reproduces the synchronous batches token for token; with heavy tails, across
many pause / resume cycles every trajectory is dispatched exactly once, in complete groups,
with the tokens of an uninterrupted run (engine-resident KV, pooled KV and re-prefill
misses alike); save -> kill -> load -> continue gives the same groups as an uninterrupted
scheduler; staleness admission; the KV pool's LRU / write-back; the auto-throttle rule.

Shape legend: none (token lists).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3post.envs.families.registry import get_family
from k3post.models import build_tiny_moe
from k3post.policy_step import TokenSequence, policy_grads, step_metrics
from k3post.rollout import EmbeddedEngine, KVState, SamplingParams
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.trajectory import Group, Trajectory
from k3post.xtml import EOM, XTML

TOL = 1e-5
FAM = get_family("general.arithmetic")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(xtml_tokenizer):
    """(model, tokenizer, xtml) with a fresh fp32 tiny Qwen3-MoE."""
    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    return model.eval(), tok, XTML(tok)


def pareto_sampling(traj: Trajectory, turn: int) -> SamplingParams:
    """max_tokens ~ Pareto(x_m = 3, alpha = 1.1) capped at 120, drawn from the trajectory seed."""
    u = random.Random(traj.seed * 31 + turn).random()
    return SamplingParams(max_tokens=min(120, int(3 * (1.0 - u) ** (-1 / 1.1))), ignore_eos=True)


def _loop(tiny, *, slots: int = 4, sampling_fn=pareto_sampling, sampling: SamplingParams | None = None) -> AgentLoop:
    model, tok, xtml = tiny
    return AgentLoop(EmbeddedEngine(model, tok, max_batch_size=slots), xtml, FAM.make_env, sampling=sampling, sampling_fn=sampling_fn)


def _drain(sch: PartialRolloutScheduler, max_iters: int = 200) -> list[tuple[int, list[Group]]]:
    """Run iterations until no prompt and no trajectory is left; (iteration, groups) per iteration."""
    out = []
    for _ in range(max_iters):
        if not sch.trajectories() and not sch.num_pending_prompts:
            return out
        out.append((sch.iteration + 1, sch.run_iteration()))
    raise AssertionError("scheduler did not drain")


def _reference(tiny, groups: list[Group], **kw) -> dict[str, Trajectory]:
    """Every dispatched trajectory re-run uninterrupted (synchronous AgentLoop, same seeds)."""
    fresh = [
        Trajectory(traj_id=t.traj_id, group_id=t.group_id, sample_index=t.sample_index, seed=t.seed, task=t.task)
        for g in groups for t in g.trajectories
    ]
    _loop(tiny, slots=8, **kw).run(fresh)
    return {t.traj_id: t for t in fresh}


def _assert_same(a: Trajectory, b: Trajectory) -> None:
    assert a.token_ids == b.token_ids, a.traj_id
    assert a.trainable == b.trainable and a.versions == b.versions and a.finish == b.finish and a.reward == b.reward
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL


def test_lambda_one_reproduces_synchronous_batches(tiny):
    tasks = FAM.generate(6, seed=11)
    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    sch = PartialRolloutScheduler(_loop(tiny, slots=3, sampling_fn=None, sampling=sampling), n_prompts=3, k=2, lambda_=1.0, seed=5)
    batches = [sch.run_iteration(tasks[:3]), sch.run_iteration(tasks[3:])]
    for it, batch in enumerate(batches):
        # synchronous: the same N prompts x K samples, run to completion together
        sync = [
            Trajectory(traj_id=f"g{gid}/s{j}", group_id=gid, sample_index=j, seed=trajectory_seed(5, gid, j), task=task.to_dict())
            for gid, task in zip(range(3 * it, 3 * it + 3), tasks[3 * it : 3 * it + 3]) for j in range(2)
        ]
        _loop(tiny, slots=6, sampling_fn=None, sampling=sampling).run(sync)
        assert sorted(g.group_id for g in batch) == [3 * it, 3 * it + 1, 3 * it + 2]
        got = sorted((t for g in batch for t in g.trajectories), key=lambda t: t.traj_id)
        for a, b in zip(got, sorted(sync, key=lambda t: t.traj_id)):
            _assert_same(a, b)
        assert all(t.pauses == 0 for t in got)
    assert not sch.trajectories() and sch.stats["pauses"] == 0


@pytest.mark.parametrize(
    "lambda_, pool_bytes, resident_bytes",
    [
        (0.5, 0, 0),  # every resume re-prefills (KV miss)
        (0.6, 1 << 30, 0),  # every resume prefetched from the CPU pool (KV hit)
        (0.4, 1 << 30, 1 << 30),  # every resume finds its KV still in the engine
        (0.5, 1_500_000, 1_000_000),  # mixed: resident, pooled, evicted (measured 6 / 12 / 6 of 24 resumes)
    ],
)
def test_heavy_tails_no_trajectory_lost_or_duplicated(tiny, lambda_, pool_bytes, resident_bytes):
    pool = KVPool(pool_bytes)
    sch = PartialRolloutScheduler(
        _loop(tiny), n_prompts=4, k=3, lambda_=lambda_, seed=1, kv_pool=pool, resident_kv_bytes=resident_bytes
    )
    sch.add_prompts(FAM.generate(14, seed=2))
    per_iter = _drain(sch)
    groups = [g for _, gs in per_iter for g in gs]
    ids = [t.traj_id for g in groups for t in g.trajectories]
    assert len(ids) == len(set(ids)) == 14 * 3  # none lost, none duplicated
    assert sorted(g.group_id for g in groups) == list(range(14))
    for g in groups:
        assert [t.sample_index for t in g.trajectories] == [0, 1, 2] and all(t.done for t in g.trajectories)
    assert max(t.pauses for g in groups for t in g.trajectories) >= 3  # long tails span many iterations
    ref = _reference(tiny, groups)
    for g in groups:
        for t in g.trajectories:
            _assert_same(t, ref[t.traj_id])
    s = sch.stats
    assert s["kv_resumes"] > 0
    if pool_bytes == 0 and resident_bytes == 0:
        assert s["kv_misses"] == s["kv_resumes"] and s["kv_pool_hits"] == s["kv_resident_hits"] == 0
    elif resident_bytes == 0:
        assert s["kv_pool_hits"] == s["kv_resumes"] and pool.stats["puts"] == s["kv_writebacks"] > 0
    elif resident_bytes >= 1 << 30:
        assert s["kv_resident_hits"] == s["kv_resumes"] and pool.stats["puts"] == 0  # write-back: never written
    else:
        assert s["kv_resident_hits"] > 0 and s["kv_pool_hits"] > 0 and s["kv_misses"] > 0
    assert sch.kv_hit_rate() == (s["kv_resident_hits"] + s["kv_pool_hits"]) / s["kv_resumes"]
    assert sum(sch.staleness_hist.values()) == sum(t.num_sampled for g in groups for t in g.trajectories)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lambda_=st.floats(0.2, 0.9),
    pool_kib=st.integers(0, 800),
    resident_kib=st.integers(0, 400),
    slots=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_any_pause_resume_schedule_keeps_every_trajectory_exactly(tiny, lambda_, pool_kib, resident_kib, slots, seed):
    """Property: whatever λ, KV budgets, engine slots and seed, every admitted trajectory is
    dispatched once, in a complete group, with its uninterrupted tokens."""
    sch = PartialRolloutScheduler(
        _loop(tiny, slots=slots), n_prompts=3, k=2, lambda_=lambda_, seed=seed,
        kv_pool=KVPool(pool_kib << 10), resident_kv_bytes=resident_kib << 10,
    )
    sch.add_prompts(FAM.generate(7, seed=seed))
    groups = [g for _, gs in _drain(sch) for g in gs]
    assert sorted(t.traj_id for g in groups for t in g.trajectories) == sorted(f"g{i}/s{j}" for i in range(7) for j in range(2))
    ref = _reference(tiny, groups)
    for g in groups:
        for t in g.trajectories:
            _assert_same(t, ref[t.traj_id])
    assert not sch.trajectories() and sch.loop.engine.num_paused == 0 and not sch._resident  # nothing left behind


def test_save_kill_load_continues_like_uninterrupted(tiny, tmp_path):
    tasks = FAM.generate(10, seed=4)

    def make() -> PartialRolloutScheduler:
        return PartialRolloutScheduler(_loop(tiny), n_prompts=3, k=2, lambda_=0.5, seed=9, kv_pool=KVPool(1 << 30))

    whole = make()
    whole.add_prompts(tasks)
    expected = _drain(whole)

    first = make()
    first.add_prompts(tasks)
    got = [(first.iteration + 1, first.run_iteration()) for _ in range(3)]
    assert first.paused() or any(not t.done for t in first.trajectories())
    first.save(tmp_path / "state.json")
    assert not list(tmp_path.glob("*.tmp"))  # atomic write leaves no temporary file
    del first  # the run is killed: engine, KV and live envs are gone

    second = make()
    second.load(tmp_path / "state.json")
    got += _drain(second)
    assert [(i, [g.group_id for g in gs]) for i, gs in got] == [(i, [g.group_id for g in gs]) for i, gs in expected]
    for (_, ga), (_, gb) in zip(got, expected):
        for a, b in zip(ga, gb):
            for ta, tb in zip(a.trajectories, b.trajectories):
                _assert_same(ta, tb)
    assert second.stats["kv_misses"] > 0  # the restored run re-prefilled what had KV before the kill


def test_staleness_admission_blocks_new_prompts(tiny):
    model = tiny[0]
    loop = _loop(tiny)
    sch = PartialRolloutScheduler(loop, n_prompts=2, k=2, lambda_=0.25, max_staleness=1, seed=3, kv_pool=KVPool(1 << 30))
    sch.add_prompts(FAM.generate(12, seed=6))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    sch.run_iteration()
    assert sch.paused() and sch.oldest_paused_version() == 0
    admitted = sch.stats["admitted_groups"]
    for _ in range(2):  # two policy updates while trajectories are paused
        loop.engine.update_weights(weights)
    assert loop.engine.version == 2 and sch.admission_blocked()
    sch.run_iteration()
    assert sch.stats["admitted_groups"] == admitted and sch.stats["admission_blocked"] == 1
    groups = [g for _, gs in _drain(sch) for g in gs]
    assert sch.stats["admitted_groups"] == 12  # admission resumes once the old ones are gone
    versions = {v for g in groups for t in g.trajectories for v, m in zip(t.versions, t.trainable) if m}
    assert versions == {0, 2}
    assert max(sch.staleness_hist) == 2 and min(sch.staleness_hist) == 0


@pytest.mark.parametrize("reuse", [True, False])
def test_resume_kv_reuse_or_reprefill_and_the_gap_each_leaves(tiny, reuse):
    """Trajectories paused across a weight update: with ``reuse_stale_kv`` (rl.rollout.resume_kv=reuse) the tokens they
    sample next attend to KV of the old weights and say so (kv_version < version); the trainer's gap on exactly
    those tokens is the stale KV's (`policy_grads` counts it apart, ``rollout_gap_stale_kv_*``), while the gap of
    the tokens sampled over fresh KV stays at kernel noise. With re-prefill no token is stale."""
    model = build_tiny_moe(len(tiny[1]), seed=5, pad_token_id=tiny[1].pad_token_id,
                           eos_token_id=tiny[1].convert_tokens_to_ids(EOM)).eval()
    loop = AgentLoop(EmbeddedEngine(model, tiny[1], max_batch_size=4), tiny[2], FAM.make_env, sampling_fn=pareto_sampling)
    sch = PartialRolloutScheduler(loop, n_prompts=2, k=2, lambda_=0.25, max_staleness=4, seed=3,
                                  kv_pool=KVPool(1 << 30), reuse_stale_kv=reuse)
    sch.add_prompts(FAM.generate(4, seed=6))
    groups = list(sch.run_iteration())
    assert sch.paused()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    loop.engine.update_weights(new)
    groups += [gr for _, gs in _drain(sch) for gr in gs]
    trajs = [t for gr in groups for t in gr.trajectories]
    stamped = [(v, kv) for t in trajs for v, kv, m in zip(t.versions, t.kv_versions, t.trainable) if m]
    assert all(0 <= kv <= v for v, kv in stamped)
    assert all(kv == 0 for v, kv in stamped if v == 0)
    n_stale = sum(kv < v for v, kv in stamped)
    assert (n_stale > 0) if reuse else (n_stale == 0 and sch.stats["kv_stale_dropped"] > 0)
    seqs = [TokenSequence(t.token_ids, t.trainable, t.logprobs, [0.0] * len(t.token_ids), t.versions, t.kv_versions)
            for t in trajs if t.num_sampled]
    sums = policy_grads(model, [([s], 0) for s in seqs], pad_id=0, token_normalizer=1.0, version=1)
    m = step_metrics(sums, n_total=1, n_seqs=len(seqs), micro_batches=len(seqs), grad_norm=0.0, version=1)
    model.zero_grad(set_to_none=True)
    assert m["rollout_gap_tokens"] > 0 and m["rollout_gap_max"] < 1e-3  # fresh KV: engine and trainer agree
    assert m["rollout_gap_stale_kv_tokens"] == n_stale
    if reuse:
        assert m["rollout_gap_stale_kv_mean"] > 100 * m["rollout_gap_max"]
    assert m["policy_moved_gap_tokens"] == sum(v == 0 for v, _ in stamped) and m["policy_moved_gap_mean"] > 1e-3


def _kv(n: int, version: int = 0) -> KVState:
    return KVState([torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)], list(range(n)), version)


def test_kv_pool_lru_by_bytes():
    pool = KVPool(192)  # 2-token entries take 2 tensors x [1, 2, 2] fp32 = 32 bytes: room for 6
    assert _kv(2).nbytes == 32
    for i in range(6):
        assert pool.put(f"t{i}", _kv(2))
    assert pool.keys() == ["t0", "t1", "t2", "t3", "t4", "t5"] and pool.nbytes == 192
    assert pool.put("big", _kv(4))  # 64 bytes: the two least recently used go
    assert pool.keys() == ["t2", "t3", "t4", "t5", "big"] and pool.stats["evictions"] == 2
    assert not pool.put("huge", _kv(13))  # larger than the budget: dropped, nothing evicted for it
    assert "huge" not in pool and pool.stats["evictions"] == 3
    assert pool.take("t3") is not None and pool.take("t3") is None and pool.take("t0") is None
    assert pool.stats["hits"] == 1 and pool.stats["misses"] == 2 and pool.hit_rate() == 1 / 3
    assert pool.nbytes == 160 and pool.stats["peak_bytes"] == 192
    pool.discard("t4")
    assert pool.keys() == ["t2", "t5", "big"] and pool.stats["discards"] == 1
    with pytest.raises(ValueError, match="budget_bytes"):
        KVPool(-1)
    with pytest.raises(ValueError, match="KVState"):
        pool.put("x", "not kv")  # type: ignore[arg-type]
    state = pool.state_dict()
    fresh = KVPool(10)
    fresh.load_state_dict(state)
    assert len(fresh) == 0 and fresh.stats["hits"] == 1


def test_write_back_only_on_eviction_and_offload(tiny):
    pool = KVPool(1 << 30)
    sch = PartialRolloutScheduler(_loop(tiny), n_prompts=2, k=2, lambda_=0.25, kv_pool=pool, resident_kv_bytes=1 << 30)
    sch.add_prompts(FAM.generate(4, seed=8))
    sch.run_iteration()
    n_resident = sum(1 for t in sch.paused() if t.traj_id in sch._kv_expected)
    assert n_resident > 0 and len(pool) == 0 and pool.stats["puts"] == 0  # paused KV stays in the engine
    sch.offload_kv()  # e.g. before a co-located train step
    assert len(pool) == n_resident == sch.stats["kv_writebacks"] and sch.loop.engine.num_paused == 0
    sch.run_iteration()
    assert sch.stats["kv_pool_hits"] == n_resident


def test_auto_throttle_rule(tiny):
    # KV pressure (any utilisation above kv_high = 0): multiplicative decrease to the floor
    sch = PartialRolloutScheduler(_loop(tiny, slots=4), n_prompts=4, k=2, lambda_=1.0, min_concurrency=2, kv_high=0.0, kv_low=0.0)
    assert sch.concurrency == 8
    sch.run_iteration(FAM.generate(4, seed=1))
    assert sch.concurrency == 2 and sch.stats["throttle_down"] >= 2
    # room (utilisation below kv_low = 1) with a backlog and an empty engine queue: additive increase
    sch = PartialRolloutScheduler(_loop(tiny, slots=4), n_prompts=8, k=3, lambda_=1.0, kv_high=1.0, kv_low=1.0)
    start = sch.concurrency
    sch.run_iteration(FAM.generate(8, seed=1))
    assert sch.concurrency > start and sch.stats["throttle_up"] >= 1 and sch.concurrency <= 24


def test_scheduler_validation(tiny):
    loop = _loop(tiny)
    with pytest.raises(ValueError, match="lambda_"):
        PartialRolloutScheduler(loop, n_prompts=2, k=2, lambda_=0.0)
    with pytest.raises(ValueError, match="lambda_"):
        PartialRolloutScheduler(loop, n_prompts=2, k=2, lambda_=1.5)
    with pytest.raises(ValueError, match="k must"):
        PartialRolloutScheduler(loop, n_prompts=2, k=0)
    with pytest.raises(ValueError, match="max_staleness"):
        PartialRolloutScheduler(loop, n_prompts=2, k=2, max_staleness=-1)
    with pytest.raises(ValueError, match="AgentLoop"):
        PartialRolloutScheduler(object(), n_prompts=2, k=2)  # type: ignore[arg-type]
    sch = PartialRolloutScheduler(loop, n_prompts=2, k=2)
    with pytest.raises(ValueError, match="Task"):
        sch.add_prompts(["not a task"])  # type: ignore[list-item]
    other = PartialRolloutScheduler(loop, n_prompts=3, k=2)
    with pytest.raises(ValueError, match="n_prompts=2"):
        other.load_state_dict(sch.state_dict())
    with pytest.raises(ValueError, match="no scheduler state"):
        sch.load("/nonexistent/state.json")


def test_trajectory_and_group_round_trip(tiny):
    loop = _loop(tiny)
    sch = PartialRolloutScheduler(loop, n_prompts=2, k=2, lambda_=0.5)
    groups = sch.run_iteration(FAM.generate(2, seed=3))
    for t in sch.trajectories() + [t for g in groups for t in g.trajectories]:
        assert Trajectory.from_dict(t.to_dict()) == t
    for g in groups:
        back = Group.from_dict(g.to_dict())
        assert back.trajectories == g.trajectories and back.rewards == g.rewards
    with pytest.raises(ValueError, match="status"):
        Trajectory(traj_id="x", group_id=0, sample_index=0, seed=0, task={}, status="lost")  # type: ignore[arg-type]
    # a trajectory saved before kv_versions existed loads with -1 (unknown) for every token
    t = next(t for g in groups for t in g.trajectories)
    old = {k: v for k, v in t.to_dict().items() if k != "kv_versions"}
    assert Trajectory.from_dict(old).kv_versions == [-1] * len(t.token_ids)
    assert set(t.kv_versions) == {-1, 0} and all(kv == 0 for kv, m in zip(t.kv_versions, t.trainable) if m)


def test_kv_pool_tensor_state_round_trip():
    """A checkpoint keeps the pool's entries (tensors) in LRU order; loading them back counts no puts."""
    pool = KVPool(10_000)
    pool.put("a", _kv(3, version=1))
    pool.put("b", _kv(5, version=2))
    pool.take("a")
    pool.put("a", _kv(3, version=4))  # now LRU order b, a
    saved = pool.tensor_state()
    fresh = KVPool(10_000)
    fresh.load_state_dict(pool.state_dict())
    fresh.load_tensor_state(saved)
    assert fresh.keys() == ["b", "a"] and fresh.nbytes == pool.nbytes
    assert fresh.stats == pool.stats
    kv = fresh.take("a")
    assert kv is not None and kv.weight_version == 4 and torch.equal(kv.keys[0], saved[1]["keys"][0])
