"""The thread policy (`k3post.threads`): its choices, the cgroup quota it reads, and a command running with them."""

import json
import logging
import multiprocessing as mp
import os
import sys

import pytest
import torch

from k3post.threads import (Cores, child_threads, cgroup_quota, command_plan, plan_threads, record_plan, seen_cores,
                            use_threads)


def test_affinity_smaller_than_the_cpu_count_is_what_auto_uses():
    plan = plan_threads(Cores(cpu_count=64, affinity=3), {"trainer": 1})
    assert plan.cores.usable == 3 and plan.per_process == 3 and not plan.warnings
    assert "3 usable" in plan.describe() and "affinity 3" in plan.describe()


@pytest.mark.parametrize("quota, threads", [(1.5, 1), (2.0, 2), (0.5, 1), (3.9, 3)])
def test_a_cgroup_quota_is_rounded_down(quota, threads):
    # 1.5 CPUs: two busy threads would be throttled a quarter of every period, so one
    plan = plan_threads(Cores(cpu_count=8, affinity=8, quota=quota), {"trainer": 1})
    assert plan.per_process == threads


def test_workers_share_the_cores_never_below_one_thread():
    cores = Cores(cpu_count=16, affinity=8)
    assert plan_threads(cores, {"trainer": 1}).per_process == 8
    assert plan_threads(cores, {"trainer": 1, "engine servers": 2}).per_process == 2  # 8 // 3
    assert plan_threads(cores, {"RL domain workers": 3}).per_process == 2
    many = plan_threads(Cores(cpu_count=2, affinity=2), {"RL domain workers": 3})
    assert many.per_process == 1 and many.total_workers == 3
    assert any("time-share" in w for w in many.warnings)  # 3 busy threads on 2 cores is said, not hidden
    assert plan_threads(cores, {"a": 0, "b": 2}).workers == {"b": 2}


def test_a_pinned_count_is_kept_on_any_machine():
    # the numbers depend on the thread count: run.threads=2 means 2 on a laptop and on a 64-core server
    for cores in (Cores(64, 64), Cores(2, 2), Cores(4, None, 2.0)):
        plan = plan_threads(cores, {"trainer": 1}, requested=2)
        assert plan.per_process == 2 and plan.budget == 2 and not plan.warnings
        assert "pinned" in plan.reason
    # shared by the processes running at once, as the demo's SFT pair and RL domains always were
    assert plan_threads(Cores(64, 64), {"SFT (QAT)": 1, "SFT (no QAT)": 1}, requested=2).per_process == 1
    assert plan_threads(Cores(64, 64), {"RL domain workers": 3}, requested=2).per_process == 1


def test_a_request_over_the_cores_is_kept_with_a_logged_warning(caplog):
    plan = plan_threads(Cores(cpu_count=8, affinity=2), {"trainer": 1}, requested=4)
    assert plan.per_process == 4
    assert len(plan.warnings) == 1 and "run.threads=4 is more than the 2 core(s)" in plan.warnings[0]
    before = torch.get_num_threads()
    with caplog.at_level(logging.WARNING, logger="k3post.threads"), use_threads(plan, "test"):
        assert torch.get_num_threads() == 4
    assert torch.get_num_threads() == before
    assert any(r.levelno == logging.WARNING and "more than the 2 core(s)" in r.getMessage() for r in caplog.records)


def test_omp_num_threads_of_the_environment_caps_auto_only():
    cores = Cores(cpu_count=8, affinity=8, env_limit=1)
    assert plan_threads(cores, {"trainer": 1}).per_process == 1
    assert plan_threads(cores, {"trainer": 1}, requested=2).per_process == 2


def test_bad_plans_are_errors():
    with pytest.raises(ValueError, match=r"run.threads must be >= 0"):
        plan_threads(Cores(2, 2), {"trainer": 1}, requested=-1)
    with pytest.raises(ValueError, match="at least one process"):
        plan_threads(Cores(2, 2), {"trainer": 0})


def _cgroup(tmp_path, v2=None, v1=None):
    """A fake /sys/fs/cgroup tree and /proc/self/cgroup: the process in /a/b, quotas on the given folders."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "cg"
    for rel, text in (v2 or {}).items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text)
    for rel, (quota, period) in (v1 or {}).items():
        d = root / "cpu" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("garbage\n4:memory:/x\n1:cpu,cpuacct:/a/b\n0::/a/b\n")
    return root, proc


def test_cgroup_quota_v2_takes_the_tightest_ancestor(tmp_path):
    root, proc = _cgroup(tmp_path, v2={"a/b": "max 100000\n", "a": "150000 100000\n", ".": "400000 100000\n"})
    assert cgroup_quota(root, proc) == 1.5
    root, proc = _cgroup(tmp_path / "u", v2={"a/b": "max 100000\n"})
    assert cgroup_quota(root, proc) is None


def test_cgroup_quota_v1(tmp_path):
    root, proc = _cgroup(tmp_path, v1={"a/b": (250000, 100000), ".": (-1, 100000)})
    assert cgroup_quota(root, proc) == 2.5
    root, proc = _cgroup(tmp_path / "none")
    assert cgroup_quota(root, proc) is None


def test_seen_cores_reads_this_process():
    cores = seen_cores()
    assert cores.cpu_count == os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        assert cores.affinity == len(os.sched_getaffinity(0))
    assert 1 <= cores.usable <= cores.cpu_count


def _child_threads(out):
    import torch as t

    out.put((t.get_num_threads(), child_threads()))


def test_children_start_with_the_plan(tmp_path):
    """A spawned child's torch (OpenMP) starts with the plan's count, before it sets anything itself."""
    torch_before = torch.get_num_threads()
    env_before = os.environ.get("OMP_NUM_THREADS")
    plan = plan_threads(Cores(8, 8), {"workers": 3}, requested=3)  # 1 each; this test process runs 2 or more
    ctx = mp.get_context("spawn")
    with use_threads(plan, "test: workers", run=tmp_path):
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        q = ctx.Queue()
        p = ctx.Process(target=_child_threads, args=(q,))
        p.start()
        got = q.get(timeout=120)
        p.join()
    assert got == (1, 1)
    assert torch.get_num_threads() == torch_before and os.environ.get("OMP_NUM_THREADS") == env_before
    (entry,) = json.loads((tmp_path / "threads.json").read_text())
    assert entry["name"] == "test: workers" and entry["torch_threads"] == 1 and entry["workers"] == {"workers": 3}
    assert record_plan(tmp_path) is None  # no plan in force: nothing recorded


def _records(n):
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families import EFFORTS, get_family

    fam = get_family("general.arithmetic")
    out = []
    for i, t in enumerate(fam.generate(n, seed=0)):
        ep = run_episode_sync(fam.reference_policy(t, EFFORTS[i % 3]), fam.make_env(t), t)
        out.append({"messages": ep.messages, "tools": None, "effort": EFFORTS[i % 3]})
    return out


def test_sft_command_trains_with_run_threads(tmp_path):
    """`k3post sft ... run.threads=1` in a process running 2 threads: every forward of the training runs with 1
    (a forward pre-hook reads torch.get_num_threads()), the log and threads.json say so, and the process's own
    count comes back afterwards. Before the policy, the command ignored run.threads and ran 2."""
    from k3post.cli import main
    from k3post.io import write_jsonl

    assert main(["init-model", str(tmp_path / "m"), "--vocab-size", "320"]) == 0
    data = write_jsonl(tmp_path / "d.jsonl", _records(8))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run:\n  root: {tmp_path}\n  name: r\nmodel:\n  path: {tmp_path / 'm'}\n"
                   "sft:\n  steps: 2\n  rows_per_batch: 1\n  progress: false\n")
    seen = set()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.add(torch.get_num_threads()))
    try:
        assert main(["sft", str(cfg), f"sft.train_file={data}", "run.threads=1"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        hook.remove()
        torch.set_num_threads(before)
    assert seen == {1}
    run = tmp_path / "r"
    (entry,) = json.loads((run / "threads.json").read_text())
    assert entry["name"] == "k3post sft" and entry["torch_threads"] == 1 and entry["requested"] == 1
    log = (run / "k3post.log").read_text()
    assert "torch.get_num_threads()=1" in log and "made with 1 thread(s) per process" in log


def test_command_plan_counts_local_ranks_and_launched_servers():
    from k3post.config import load_config

    cores = Cores(8, 8)
    cfg = load_config(None, ["distributed.fsdp.ranks=2", "rl.rollout.engine.kind=http", "rl.rollout.engine.launch=1"])
    assert command_plan(cfg, "rl", cores=cores).workers == {"trainer": 1, "trainer ranks": 1, "engine servers": 1}
    assert command_plan(cfg, "rl", cores=cores).per_process == 2  # 8 // 3
    assert command_plan(cfg, "draft", cores=cores).workers == {"trainer": 1}
    assert command_plan(load_config(None, ["run.threads=2"]), "sft", cores=cores).per_process == 2


def test_serve_threads_follow_the_policy(capsys):
    from k3post.cli import main

    assert main(["serve", "/nonexistent-model", "--threads", "-1"]) == 2
    assert "--threads must be >= 0 (0: chosen from the cores" in capsys.readouterr().err
    assert main(["serve", "/nonexistent-model", "--threads", "64"]) == 2  # the plan is said before the model loads
    err = capsys.readouterr().err
    assert "64 torch thread(s) per process (1 server); --threads=64 pinned" in err
    if seen_cores().usable < 64:
        assert "WARNING: --threads=64 is more than the" in err


@pytest.mark.parametrize("env, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_sets_sleeping_waits_before_torch_loads(env, expected):
    """`k3post` sets OMP_WAIT_POLICY=PASSIVE before anything imports torch (libgomp reads it when it loads), so
    this process and every child it starts run with idle workers asleep; a value the user set is kept."""
    import subprocess
    import sys

    code = ("import os, sys\nfrom k3post.cli import main\nmain(['tasks', 'list'])\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
            "import torch\nfrom k3post.threads import wait_policy\nprint(wait_policy())\n")
    child_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env is not None:
        child_env["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, timeout=300)
    assert out.returncode == 0, out.stderr
    *_, first, second = out.stdout.strip().splitlines()
    assert first == f"{expected} False" and second == f"OMP_WAIT_POLICY={expected}"


def test_the_recorded_plan_names_the_wait_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with use_threads(plan_threads(Cores(2, 2), {"trainer": 1}, requested=1), "test: waits", run=tmp_path):
        pass
    (entry,) = json.loads((tmp_path / "threads.json").read_text())
    assert entry["wait_policy"] == "OMP_WAIT_POLICY=PASSIVE"


_PARENT = '''
import multiprocessing as mp, sys, time

def child(watch):
    if watch:
        from k3post.threads import exit_with_parent
        exit_with_parent(poll_s=0.1)
    time.sleep(120)

if __name__ == "__main__":
    if sys.argv[2] == "forkserver":  # as the pipeline starts its workers: from a fork server
        from k3post import workers
        workers.PRELOAD = ()  # who is whose parent does not depend on what the server imports (torch: ~4.5 CPU-s)
        p = workers.worker_process(child, (sys.argv[1] == "watch",))
    else:
        p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1] == "watch",))
    p.start()
    print(p.pid, flush=True)
    time.sleep(120)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
@pytest.mark.parametrize("watch", [True, False])
def test_a_child_exits_when_its_command_is_killed(tmp_path, watch, start):
    """A child that called exit_with_parent is gone within seconds of its parent's SIGKILL (which runs no
    cleanup: a daemon child would survive it); without the call the child lives on (the control). Spawned, or
    forked by `k3post.workers`' fork server (whose child the parent is not: the server outlives neither)."""
    import signal
    import subprocess
    import time

    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), "watch" if watch else "plain", start], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)  # several of the watcher's polls: it keeps a child whose parent lives
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + (30 if watch else 2)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(child) is not watch
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_test_run_starts_one_worker_per_allowed_core_at_most_four(monkeypatch):
    """`tests/conftest.py`'s ``-n auto``: pytest-xdist workers follow the cores this process may use (its affinity, not
    the machine's count), at least 1 and at most `MAX_WORKERS` (4)."""
    import os

    from tests import conftest

    for cores, want in ((1, 1), (2, 2), (3, 3), (16, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert conftest.pytest_xdist_auto_num_workers(None) == want, cores


def test_the_test_run_writes_bytecode_and_its_children_do_too():
    """`tests/conftest.py` turns bytecode writing back on for the run (PYTHONDONTWRITEBYTECODE, which container images
    and this project's sessions set, made each of the run's processes compile k3post and the rewritten tests from source):
    this worker writes it, and a process it starts inherits no PYTHONDONTWRITEBYTECODE."""
    import subprocess

    assert not sys.dont_write_bytecode
    out = subprocess.run([sys.executable, "-c", "import os, sys; print(sys.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE' in os.environ)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
