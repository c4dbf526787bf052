"""Ray orchestration (k3post/distributed/ray_cluster.py) on a local 2-CPU Ray cluster: the placement plan,
the nine-experts jobs and MOPD teachers on Ray against the local run, and a killed engine-server actor.

Shape legend: none (token lists and tables).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from k3post.config import load_config  # noqa: E402
from k3post.config.distributed import DistributedConfig, RolesConfig  # noqa: E402
from k3post.distributed.ray_cluster import RayCluster, RayTeacherPool, engine_config, plan_placement  # noqa: E402
from k3post.mopd import train_mopd  # noqa: E402

# the tiny models and runs of the stage tests (fixtures imported: pytest finds them in this module)
from test_http_engine import _rl_run, _same_steps, model_dir  # noqa: E402,F401
from test_mopd import _model, _run_cfg, _strip, folders  # noqa: E402,F401
from test_rl import _save, _two_domains, warm_policy  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 trainer slots (the domains' chains), 1 engine, 2 teachers: 5 bundles of 0.3 CPU; the CLI test's group takes
# 0.5 of the other 0.5 CPUs
CLUSTER = DistributedConfig(enabled=True, num_cpus=2, layout="disaggregated", cpus_per_bundle=0.3,
                            engine_max_restarts=2, roles=RolesConfig(trainers=2, engines=1, teachers=2))


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster (``ray.init(num_cpus=2)``) and placement group for the module."""
    t0 = time.perf_counter()
    c = RayCluster(CLUSTER)
    print(f"ray start-up: {time.perf_counter() - t0:.1f} s")
    yield c
    c.close()


# --------------------------------------------------------------------------- placement (no Ray needed)


def test_plan_placement_golden():
    """colocated, trainers 2, engines 1, teachers 1, judges 1, cpus_per_bundle 1:
    bundles [t0+e0, t1, teacher0, judge0] → trainer 0 and engine 0 get 1/2 CPU each on bundle 0, trainer 1
    the whole bundle 1, the teacher bundle 2, the judge bundle 3. disaggregated: one bundle per member in the
    order trainers, engines, env_workers, teachers, judges."""
    roles = RolesConfig(trainers=2, engines=1, teachers=1, judges=1)
    p = plan_placement(DistributedConfig(layout="colocated", roles=roles))
    assert p.bundles == [{"CPU": 1.0}] * 4 and p.cpus == 4.0
    assert p.slots == {"trainers": [(0, 0.5), (1, 1.0)], "engines": [(0, 0.5)], "env_workers": [],
                       "teachers": [(2, 1.0)], "judges": [(3, 1.0)]}
    p = plan_placement(DistributedConfig(layout="disaggregated", cpus_per_bundle=0.5,
                                         roles=RolesConfig(trainers=2, engines=2, env_workers=1, teachers=1)))
    assert p.bundles == [{"CPU": 0.5}] * 6
    assert p.slots == {"trainers": [(0, 0.5), (1, 0.5)], "engines": [(2, 0.5), (3, 0.5)], "env_workers": [(4, 0.5)],
                       "teachers": [(5, 0.5)], "judges": []}


def test_distributed_config_names_the_key():
    cfg = load_config(overrides=["distributed.enabled=true", "distributed.layout=disaggregated",
                                 "distributed.roles.teachers=2", "distributed.cpus_per_bundle=0.5"]).distributed
    assert (cfg.enabled, cfg.layout, cfg.roles.teachers, cfg.cpus_per_bundle) == (True, "disaggregated", 2, 0.5)
    for override, message in [("distributed.layout=split", r"distributed.layout must be one of \('colocated', "
                                                            r"'disaggregated'\), got 'split'"),
                              ("distributed.roles.engines=-1", "distributed.roles.engines must be an int >= 0, got -1"),
                              ("distributed.roles.trainers=0", "distributed.roles.trainers must be an int >= 1, got 0"),
                              ("distributed.cpus_per_bundle=0", "distributed.cpus_per_bundle must be a number > 0"),
                              ("distributed.engine_max_restarts=-1", "distributed.engine_max_restarts must be an int >= 0"),
                              ("distributed.roles.teacher=2", "did you mean 'distributed.roles.teachers'")]:
        with pytest.raises(ValueError, match=message):
            load_config(overrides=[override])


def test_a_group_larger_than_the_cluster_is_an_error(cluster):
    big = DistributedConfig(enabled=True, cpus_per_bundle=1.0, roles=RolesConfig(trainers=3))
    with pytest.raises(ValueError, match=r"needs 3 CPUs \(3 bundles x distributed.cpus_per_bundle 1\), the cluster has 2"):
        RayCluster(big)
    assert ray.is_initialized()  # the module's cluster is left running


# --------------------------------------------------------------------------- experts and MOPD on Ray equal the local run


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _no_seconds(table):
    """A table without wall-clock fields."""
    if isinstance(table, dict):
        return {k: _no_seconds(v) for k, v in table.items() if k != "seconds" and not k.endswith("_s")}
    if isinstance(table, list):
        return [_no_seconds(v) for v in table]
    return table


def test_experts_on_ray_equal_the_local_run(warm_policy, cluster, tmp_path):
    """general (2 steps) and agents (1 step), max → low each: four Ray tasks in two chains (one per trainer
    slot, the domains in parallel) give the local run's table (curves, evaluations, budgets) and bit-equal
    expert weights; low started from max in both (init_from, and its weights differ from the SFT model's)."""
    from k3post.experts import train_experts

    model, tok = warm_policy
    init = _save(model, tok, tmp_path / "init")
    t0 = time.perf_counter()
    local = train_experts(init, _two_domains(), tmp_path / "local")
    t1 = time.perf_counter()
    remote = train_experts(init, _two_domains(), tmp_path / "ray", cluster=cluster, metrics_dir=tmp_path / "ray")
    t2 = time.perf_counter()
    print(f"experts: local {t1 - t0:.1f} s, ray {t2 - t1:.1f} s")
    names = ["general.max", "general.low", "agents.max", "agents.low"]
    assert remote["failed"] == {} and sorted(remote["experts"]) == sorted(names) == sorted(local["experts"])
    assert _no_seconds(remote) == _no_seconds(local)
    assert remote["experts"]["general.low"]["init_from"] == "general.max"
    assert json.loads((tmp_path / "ray" / "table.json").read_text())["experts"].keys() == set(names)
    sft = _weights(init)
    for name in names:
        a, b = _weights(tmp_path / "local" / name), _weights(tmp_path / "ray" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert any(not torch.equal(a[k], sft[k]) for k in a), name  # trained
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} >= {f"rl/{n}" for n in names}  # the workers' metrics reached the run's log


def _cli(warm_policy, tmp_path: Path, command: str, *overrides: str) -> list[str]:
    """``k3post COMMAND`` arguments for a tiny run "r" under ``tmp_path`` from the warm policy, with
    ``distributed.enabled=true`` and ``overrides``."""
    model, tok = warm_policy
    init = _save(model, tok, tmp_path / "init")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    return [command, str(cfg), f"run.root={tmp_path}", "run.name=r", f"rl.init={init}", "rl.n_tasks=2",
            "rl.n_prompts=1", "rl.k=2", "rl.eval_n=2", "rl.max_tokens=16", "rl.eval_max_tokens=16",
            "rl.families=[general.arithmetic]", "rl.progress=false", "qat.enabled=false", "distributed.enabled=true",
            *overrides]


def test_cli_experts_with_distributed_enabled_runs_on_ray(warm_policy, cluster, tmp_path, monkeypatch):
    """`k3post experts CONFIG distributed.enabled=true`: Ray workers train the experts into the run's folder
    (this process cannot: its `train_domain_experts` raises)."""
    import k3post.experts
    from k3post.cli import main

    def not_here(*a, **kw):
        raise AssertionError("an expert was trained in the driver process")

    monkeypatch.setattr(k3post.experts, "train_domain_experts", not_here)
    assert main(_cli(warm_policy, tmp_path, "experts", "rl.steps=1", "rl.domains=[general]",
                     "rl.effort_control.curriculum=[max,low]", "distributed.cpus_per_bundle=0.25",
                     "distributed.roles.trainers=2", "distributed.roles.engines=0")) == 0
    table = json.loads((tmp_path / "r" / "experts" / "table.json").read_text())
    assert sorted(table["experts"]) == ["general.low", "general.max"] and table["failed"] == {}
    assert (tmp_path / "r" / "experts" / "general.low" / "model.safetensors").is_file()


def test_cli_rl_with_distributed_enabled_samples_on_an_engine_actor(warm_policy, cluster, tmp_path):
    """`k3post rl CONFIG distributed.enabled=true` (colocated: trainer 0 and engine 0 on one bundle): the
    rollouts run on an `EngineServerActor` that receives every step's weights (its kept version is the
    loop's last), and the trained model is written."""
    from k3post.cli import main
    from k3post.metrics import read_metrics
    from k3post.models import load_model

    assert main(_cli(warm_policy, tmp_path, "rl", "rl.steps=2", "distributed.cpus_per_bundle=0.5",
                     "distributed.roles.engines=1")) == 0
    run = tmp_path / "r"
    rows = read_metrics(run / "metrics.jsonl", "rl/general.max")
    assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [2.0, 3.0]  # servers start 1 ahead
    kept = sorted(p.name for p in (run / "engines" / "engine-0" / "weights").iterdir() if p.name.startswith("v"))
    assert kept == ["v00000003"]  # the actor loaded the initial push and both steps' weights
    assert load_model(run / "rl" / "general.max" / "final") is not None


def test_mopd_with_two_teachers_on_ray_equals_local(xtml_tokenizer, folders, cluster, tmp_path):
    """Two teachers (t1 for general.high, t2 for general.max), each a `TeacherActor` on its own teachers
    bundle: 4 MOPD steps (λ = 0.5, both efforts drawn) give the local pool's per-step metrics and bit-equal
    student weights; each actor loaded its teacher once (the local pool, max_resident 1, evicts)."""
    tok = xtml_tokenizer
    cfg = _run_cfg(folders, experts={"general.high": folders["t1"], "general.max": folders["t2"]})
    start = _model(tok, 0)
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    ra = train_mopd(a, tok, cfg, tmp_path / "local")
    pool = RayTeacherPool(cluster, cfg.experts, max_resident=cfg.max_resident)
    try:
        assert len({id(pool._owner[e]) for e in cfg.experts}) == 2  # one actor per teacher
        rb = train_mopd(b, tok, cfg, tmp_path / "ray", pool=pool)
        stats = pool.stats
    finally:
        pool.close()
    assert rb.steps == ra.steps == 4
    assert ra.metrics.series("expert/general.high")[0] > 0 and sum(ra.metrics.series("expert/general.max")) > 0
    assert _strip(rb.metrics) == _strip(ra.metrics)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, q) for p, q in zip(b.parameters(), start.parameters()))
    assert stats["loads"] == 2 and stats["evictions"] == 0 and ra.teacher_stats["evictions"] > 0
    assert stats["sequences"] == ra.teacher_stats["sequences"] and stats["tokens"] == ra.teacher_stats["tokens"]


# --------------------------------------------------------------------------- fault tolerance


def test_a_killed_engine_actor_restarts_and_its_trajectories_resume(cluster, model_dir, xtml_tokenizer, tmp_path):
    """The RL loop (λ = 1, weights moving every step) over one `EngineServerActor`, killed by Ray
    (``ray.kill(no_restart=False)``) right after step 2 submitted its requests: Ray restarts it on the same
    URL with the weights it last loaded, the client's retries resubmit each in-flight request from its
    last known tokens, and every step trains the trajectories of the uninterrupted in-process run: the same
    ids (none lost, none twice) and tokens, versions one apart (the servers' first push), the server at the
    loop's version at the end."""
    from k3post.config.rollout import EngineConfig
    from k3post.rollout.http_engine import HTTPEngine

    steps, killed_in = 3, 2
    ref_groups, ref_recs = _rl_run(model_dir, xtml_tokenizer, EngineConfig(), 1.0, steps)
    [actor] = cluster.engine_servers(model_dir, tmp_path / "engines", max_batch_size=4)
    before = ray.get(actor.info.remote())
    http = engine_config([actor], restart_s=60.0)
    state = {"killed": False}
    step = HTTPEngine.step

    def step_then_kill(self, *a, **kw):
        if not state["killed"] and self._version == before["version"] + killed_in:  # step 2's rollout: requests in flight
            state["killed"], state["engine"] = True, self
            ray.kill(actor, no_restart=False)
        return step(self, *a, **kw)

    HTTPEngine.step = step_then_kill
    try:
        got_groups, got_recs = _rl_run(model_dir, xtml_tokenizer, http, 1.0, steps)
    finally:
        HTTPEngine.step = step
    after = ray.get(actor.info.remote())
    assert state["killed"] and after["restarts"] == 1 and after["pid"] != before["pid"] and after["url"] == before["url"]
    assert state["engine"].stats["retries"] > 0 and state["engine"].stats["dead_servers"] == 0
    off = _same_steps(got_groups, got_recs, ref_groups, ref_recs)
    assert after["version"] == steps + off  # restored at the kill's version, then two more pushes


def test_cli_rl_two_trainer_ranks_and_an_engine_actor_equals_one_rank(warm_policy, cluster, tmp_path):
    """Issue 19's CI item: `k3post rl` with 2 FSDP trainer ranks (`distributed.fsdp.ranks=2`, local gloo ranks)
    sampling on one engine-server actor on the Ray cluster, against the same run with 1 trainer rank (λ = 1:
    synchronous): the same rollouts (rewards, token counts), loss and gradient norm within fp32 reduction
    tolerance at a step with a real gradient, and final weights within 1e-5."""
    from k3post.cli import main
    from k3post.metrics import read_metrics
    from k3post.models import load_model

    # SGD: AdamW would turn step 1's rounding-level gradients (all-equal rewards there) into lr-sized steps
    args = ("rl.steps=2", "rl.lambda_=1.0", "rl.k=4", "rl.n_prompts=2", "rl.max_tokens=80", "rl.optimizer=sgd", "rl.lr=0.5",
            "distributed.cpus_per_bundle=0.5", "distributed.roles.engines=1")
    assert main(_cli(warm_policy, tmp_path / "one", "rl", *args)) == 0
    assert main(_cli(warm_policy, tmp_path / "two", "rl", *args, "distributed.fsdp.ranks=2")) == 0
    one = read_metrics(tmp_path / "one" / "r" / "metrics.jsonl", "rl/general.max")
    two = read_metrics(tmp_path / "two" / "r" / "metrics.jsonl", "rl/general.max")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["train/num_tokens"] == b["train/num_tokens"], (a, b)  # same rollouts
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5 * max(1.0, abs(a["train/loss"])), (a, b)
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) <= 1e-4 * max(1.0, abs(a["train/grad_norm"])), (a, b)
    w1 = load_model(tmp_path / "one" / "r" / "rl" / "general.max" / "final").state_dict()
    w2 = load_model(tmp_path / "two" / "r" / "rl" / "general.max" / "final").state_dict()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    assert two[-1]["train/grad_norm"] > 1e-3  # a step that trained
