"""Infrastructure failures are not the policy's outcome (issue 30 §4.5): an episode whose env worker, sandbox,
browser or judge failed is masked out of its group (never a reward), counted, retried / dropped, and too many of
them fail the run.

Each test fails on the code before the fix: there a lost worker / an unavailable sandbox ended the episode
"malformed" with reward 0.0, which moved the group's mean and so every other sample's advantage; a judge's
transport failure crashed the step; evaluation counted the failures as failed tasks.

Shape legend: none (reward lists).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import pytest
import torch

from k3post.algos.advantages import group_advantages, group_advantages_from_groups
from k3post.config.effort import EffortConfig
from k3post.envs.env import EnvironmentLost
from k3post.envs.families.registry import get_family
from k3post.envs.families.webdev.browser import BrowserUnavailableError
from k3post.envs.sandbox import Sandbox, SandboxUnavailableError, available_backends
from k3post.envs.tools import ToolContext, ToolSpec, call_tool
from k3post.errors import InfrastructureError, JudgeUnavailableError, infra_kind
from k3post.loop import PolicyLoop
from k3post.rewards.effort import BudgetTable, TaskSamples, task_key
from k3post.rewards.grm import GroupGRM, PolicyJudge, judge_transport_failure
from k3post.config.rl import RLConfig
from k3post.stages.rl import rl_signal
from k3post.rollout.evaluation import paired_passes, summarize_trajectories
from k3post.rollout.trajectory import Group, Trajectory, outcome_metrics

TASK = get_family("general.arithmetic").generate(1, seed=0)[0]


def _traj(j: int, reward: float | None, *, infra: str | None = None, gid: int = 0, task=TASK) -> Trajectory:
    """A finished sample with 3 prompt tokens and 2 sampled ones."""
    return Trajectory(traj_id=f"g{gid}/s{j}", group_id=gid, sample_index=j, seed=j, task=task.to_dict(),
                      token_ids=[1, 2, 3, 4, 5], trainable=[False, False, False, True, True], logprobs=[0, 0, 0, -1, -1],
                      versions=[-1, -1, -1, 0, 0], status="done", finish="infra" if infra else "answer", infra=infra,
                      reward=None if infra else reward, domain=task.domain, output_tokens=2, thinking_tokens=2)


def _budgets(*tasks) -> BudgetTable:
    table = BudgetTable({"test": "infra"})
    table.add_samples({task_key(t): TaskSamples(t.family, [1000], [True]) for t in tasks}, q=0.9, min_b0=1.0, floor=0.0)
    return table


def _cfg(**kw) -> RLConfig:
    base = dict(domain="general", families=["general.arithmetic"], rollout={"k": 4, "n_prompts": 1}, progress=False,
                effort="max", effort_control=EffortConfig(max_cap=100.0))
    return RLConfig().with_settings(base).with_settings(kw)


# --------------------------------------------------------------------------- the kinds


def test_infra_errors_carry_their_kind_through_the_cause_chain():
    assert (EnvironmentLost("w").kind, SandboxUnavailableError("s").kind, BrowserUnavailableError("b").kind,
            JudgeUnavailableError("j").kind) == ("env_lost", "sandbox", "browser", "judge")
    try:
        try:
            raise SandboxUnavailableError("bwrap gone")
        except SandboxUnavailableError as e:
            raise RuntimeError("the verifier could not run the tests") from e
    except RuntimeError as wrapped:
        assert infra_kind(wrapped) == "sandbox"
    assert infra_kind(ValueError("the policy's fault")) is None
    with pytest.raises(ValueError, match="kind"):
        InfrastructureError("x", kind="cosmic_rays")


def test_a_tool_handler_whose_sandbox_is_gone_raises_instead_of_answering_the_model():
    """Before: the handler's SandboxUnavailableError became an "Error: tool failed" observation that the policy
    read and answered (and was scored on). An ordinary handler error still is an observation."""
    import asyncio

    def gone(ctx, code: str) -> str:
        raise SandboxUnavailableError("no isolating backend")

    def buggy(ctx, code: str) -> str:
        raise RuntimeError("the model's code crashed")

    schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    call = {"id": "call_0", "type": "function", "function": {"name": "run", "arguments": '{"code": "1"}'}}
    ctx = ToolContext(state={}, task=TASK)
    with pytest.raises(SandboxUnavailableError):
        asyncio.run(call_tool(call, {"run": ToolSpec("run", "", schema, handler=gone)}, ctx))
    out = asyncio.run(call_tool(call, {"run": ToolSpec("run", "", schema, handler=buggy)}, ctx))
    assert out.error == "handler" and "crashed" in out.message["content"]


@pytest.mark.skipif("bwrap" not in available_backends(), reason="bwrap is not usable here")
def test_a_sandbox_whose_launcher_vanished_raises_sandbox_unavailable(monkeypatch):
    """Before: Popen's FileNotFoundError (or, behind prlimit, an exit status the verifier read as failed tests)."""
    import k3post.envs.sandbox.core as sbx  # where Sandbox looks the launcher up

    real = sbx._bwrap_argv
    monkeypatch.setattr(sbx, "_bwrap_argv", lambda *a, **k: ["/nonexistent/bwrap", *real(*a, **k)[1:]])
    with Sandbox(backend="bwrap") as sb:
        with pytest.raises(SandboxUnavailableError, match="/nonexistent/bwrap") as err:
            sb.run(["true"])
    assert infra_kind(err.value) == "sandbox"


# --------------------------------------------------------------------------- the agent loop


class _Env:
    """An env whose step (``mode="step"``) or verifier (``"verify"``) raises ``exc``."""

    def __init__(self, mode: str, exc: BaseException) -> None:
        self.mode, self.exc = mode, exc

    async def reset(self, task):
        return [{"role": "user", "content": "2 + 2?"}]

    def tool_specs(self):
        return []

    async def step(self, message):
        if self.mode == "step":
            raise self.exc
        from k3post.envs.env import StepResult

        return StepResult([], True, False, {"end": "answer"})

    def verify(self):
        if self.mode == "verify":
            raise RuntimeError("verifier") from self.exc
        from k3post.envs.task import Verdict

        return Verdict(1.0)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.fixture(scope="module")
def xtml():
    from k3post.stages.sft_data import default_corpus
    from k3post.tokenizer import train_tokenizer
    from k3post.xtml import XTML

    return XTML(train_tokenizer(default_corpus(n_per_family=1, n_main=2), vocab_size=800))


@pytest.mark.parametrize("mode, exc, kind", [
    ("step", EnvironmentLost("env worker 0 was lost"), "env_lost"),
    ("step", RuntimeError("sandbox run failed"), None),  # an env defect: still malformed
    ("verify", SandboxUnavailableError("bwrap gone"), "sandbox"),
    ("verify", BrowserUnavailableError("chromium did not start"), "browser"),
])
def test_the_agent_loop_ends_an_infra_failure_infra_not_malformed(xtml, caplog, mode, exc, kind):
    """Before: env_lost ended "malformed" with reward 0.0; a sandbox / browser failure in the verifier ended
    "malformed" (verifier_error) with reward 0.0: the same as a wrong answer."""
    from scripted_engine import ScriptedEngine

    from k3post.rollout.agent_loop import AgentLoop
    from k3post.rollout.engine import SamplingParams

    answer = xtml.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "4"}], mode="instruct")
    turn = [t for t, i in zip(answer.ids, answer.message_index) if i == 1][len(xtml.generation_prefix("instruct")):]
    engine = ScriptedEngine(lambda req: list(turn), eom_id=xtml.eom_id)
    loop = AgentLoop(engine, xtml, lambda task: _Env(mode, exc), sampling=SamplingParams(max_tokens=64), mode="instruct")
    trajs = [Trajectory(traj_id=f"g0/s{j}", group_id=0, sample_index=j, seed=j, task=TASK.to_dict()) for j in range(2)]
    with caplog.at_level(logging.WARNING, logger="k3post.rollout.agent_loop"):
        loop.run(trajs)
    loop.close()
    for t in trajs:
        if kind is None:
            assert (t.finish, t.malformed, t.infra, t.reward) == ("malformed", "env_error", None, 0.0)
        else:
            assert (t.finish, t.malformed, t.infra, t.reward) == ("infra", None, kind, None)
            assert t.verdict is not None and "not a reward" in t.verdict["diagnostics"]
    m = outcome_metrics(trajs)
    assert m["malformed_episodes"] == (2.0 if kind is None else 0.0)
    assert m["infra_episodes"] == (0.0 if kind is None else 2.0) and m.get(f"infra/{kind}", 0.0) == (2.0 if kind else 0.0)


# --------------------------------------------------------------------------- the group statistics


def test_masked_group_advantages_ignore_failed_samples():
    """Three valid samples [1, 0, 1] and one env_lost: the valid ones get exactly the advantages of the group of
    three; the lost one gets 0 whatever its (placeholder) reward. Before: the lost one's 0.0 joined the mean
    (0.5 instead of 2/3) and the valid advantages moved by 1/6."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False])
    for norm in (False, True):
        adv, zero = group_advantages(r, valid=valid, normalize_std=norm)
        ref, _ = group_advantages(r[:3], normalize_std=norm)
        assert adv[:3].tolist() == ref.tolist() and adv[3].item() == 0.0 and not zero
        adv_nan, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0, float("nan")], dtype=torch.float64), valid=valid,
                                      normalize_std=norm)
        assert adv_nan.tolist() == adv.tolist()
    unmasked, _ = group_advantages(r)
    assert unmasked[0].item() == 0.5 != 1 / 3  # what the failure did to the policy's signal before
    # one valid sample left, or valid ones all equal: zero variance (no signal), all advantages 0
    for v in ([True, False, False, False], [True, False, True, False]):
        adv, zero = group_advantages(r, valid=torch.tensor(v))
        assert bool(zero) and adv.abs().sum().item() == 0.0
    g = group_advantages_from_groups([[1.0, 0.0, 0.0], [1.0, 1.0]], valid=[[True, True, False], [True, False]])
    assert g.advantages == [[0.5, -0.5, 0.0], [0.0, 0.0]] and g.skip == [False, True]
    with pytest.raises(ValueError):
        group_advantages_from_groups([[1.0, 0.0]], valid=[[True]])


def test_rl_signal_masks_infra_samples_out_of_advantages_and_loss():
    """Group [1, 0, 1, env_lost]: advantages 1/3, -2/3, 1/3 over the three valid samples, the lost one is not
    a training sequence, and the reward metrics count the valid samples only."""
    cfg = _cfg()
    group = Group(0, TASK.to_dict(), [_traj(0, 1.0), _traj(1, 0.0), _traj(2, 1.0), _traj(3, 0.0, infra="env_lost")])
    seqs, rows = rl_signal(_budgets(TASK), cfg)([group])
    assert len(seqs) == 3
    got = [s.advantages[-1] for s in seqs]
    assert got == pytest.approx([1 / 3, -2 / 3, 1 / 3], abs=1e-6)  # float32 tokens of float64 advantages
    assert rows["reward"] == pytest.approx(2 / 3) and rows["trained_groups"] == 1.0
    assert group.trajectories[3].reward is None  # never a reward


class _DeadJudge:
    def run(self, tasks):
        raise JudgeUnavailableError("judge server unreachable")


def test_a_judge_that_cannot_answer_gives_its_group_no_reward(xtml, caplog):
    """The GRM's transport failed: the group's samples are marked "judge" and nothing of it is trained (before:
    the exception crashed the step, or a forfeit turned into ties)."""
    writing = get_family("general.writing").generate(1, seed=0)[0]
    cfg = _cfg(families=["general.writing", "general.arithmetic"], judge="policy")
    scorer = GroupGRM(_DeadJudge(), xtml)
    judged = Group(1, writing.to_dict(), [_traj(j, 0.0, gid=1, task=writing) for j in range(4)])
    fine = Group(0, TASK.to_dict(), [_traj(0, 1.0), _traj(1, 0.0), _traj(2, 1.0), _traj(3, 0.0)])
    with caplog.at_level(logging.WARNING, logger="k3post.rl"):
        seqs, rows = rl_signal(_budgets(TASK, writing), cfg, scorer)([judged, fine])
    assert len(seqs) == 4 and all(s.token_ids == [1, 2, 3, 4, 5] for s in seqs)
    assert [t.infra for t in judged.trajectories] == ["judge"] * 4 and all(t.reward is None for t in judged.trajectories)
    assert rows["trained_groups"] == 1.0 and rows["zero_variance_groups"] == 0.0 and "GRM judge" in caplog.text


def test_judge_transport_failures_become_judge_unavailable():
    """PolicyJudge over an endpoint that refuses connections: JudgeUnavailableError (an infrastructure error),
    not the raw httpx error that crashed the RL step; an answer the judge gives wrongly is not one."""
    from k3post.envs.episode import EndpointHTTPError, OpenAIPolicy
    from k3post.rewards.grm import judge_task

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    policy = OpenAIPolicy("http://judge.invalid/v1", "m", transport=httpx.MockTransport(refuse))
    task = judge_task("write a poem", ["a", "b"], task_id="grm-0")
    with pytest.raises(JudgeUnavailableError) as err:
        PolicyJudge(policy).run([task])
    assert infra_kind(err.value) == "judge"
    assert judge_transport_failure(EndpointHTTPError(503, "busy")) and not judge_transport_failure(EndpointHTTPError(400, "bad"))
    assert not judge_transport_failure(ValueError("bad scorepad"))


# --------------------------------------------------------------------------- the loop: retry, drop, rate


class _Rollout:
    """The rollout seam, answering the groups of ``script`` (one list per iteration)."""

    def __init__(self, script):
        self.script, self.queue, self.version = list(script), [], 0

    @property
    def num_pending_prompts(self):
        return len(self.queue)

    def add_prompts(self, tasks):
        self.queue += list(tasks)

    def run_iteration(self):
        self.queue.clear()
        return self.script.pop(0)

    def push_weights(self, named):
        self.version += 1
        return self.version

    def kv_hit_rate(self):
        return 0.0

    def counters(self):
        return {}

    def paused(self):
        return []


def _loop(cfg, script):
    pl = PolicyLoop.__new__(PolicyLoop)
    pl.cfg, pl.signal = cfg, rl_signal(_budgets(TASK), cfg)
    pl.rollout = _Rollout(script)
    pl.trainer = SimpleNamespace(named_weights=None)
    pl.train_step = lambda seqs, version, lr=None: {"sequences": float(len(seqs))}
    pl.step_no, pl.cursor, pl.last_groups, pl.infra_retries = 0, 0, [], {}
    return pl


def _group(gid, rewards, lost=()):
    return Group(gid, TASK.to_dict(), [_traj(j, r, gid=gid, infra="env_lost" if j in lost else None)
                                       for j, r in enumerate(rewards)])


def test_a_group_with_too_few_valid_samples_is_retried_then_dropped(caplog):
    """K=4, infra_min_valid=2: a group with one valid sample is run again (its prompt re-queued), and dropped
    when the retry fails too; a group with two valid samples trains them (masked). The step's metrics count
    every failure and the retried / dropped groups."""
    cfg = _cfg(infra_min_valid=2, infra_retries=1, infra_max_rate=1.0)
    script = [[_group(0, [1, 0, 0, 0], lost=(1, 2, 3))],  # 1 valid: retry
              [_group(1, [1, 0, 1, 0], lost=(3,))],  # the retry: 3 valid, trained
              [_group(2, [1, 0, 0, 0], lost=(1, 2, 3))],  # 1 valid: retry
              [_group(3, [0, 1, 0, 0], lost=(0, 2, 3))],  # retry failed again: dropped
              [_group(4, [1, 0, 1, 1])]]  # fine
    pl = _loop(cfg, script)
    with caplog.at_level(logging.WARNING, logger="k3post.loop"):
        rec = pl.step([TASK])
        assert [g.group_id for g in pl.last_groups] == [1]
        assert (rec["iterations"], rec["groups"], rec["infra_retried_groups"], rec["infra_dropped_groups"]) == (2, 1, 1, 0)
        assert (rec["infra_episodes"], rec["infra/env_lost"], rec["infra_rate"]) == (4.0, 4.0, 0.5)
        assert rec["train/sequences"] == 3.0
        rec = pl.step([TASK])
    assert (rec["iterations"], rec["infra_retried_groups"], rec["infra_dropped_groups"], rec["infra_episodes"]) == (3, 1, 1, 6)
    assert rec["train/sequences"] == 4.0 and "dropped" in caplog.text and pl.infra_retries == {}


def test_a_step_with_too_many_infra_failures_raises():
    """infra_max_rate=0.5: 5 of 8 episodes lost is a broken infrastructure, not a policy to train."""
    cfg = _cfg(infra_max_rate=0.5)
    pl = _loop(cfg, [[_group(0, [1, 0, 1, 0], lost=(0, 1)), _group(1, [1, 0, 1, 0], lost=(0, 1, 2))]])
    with pytest.raises(InfrastructureError, match=r"5 of 8 episodes .* rl\.infra_max_rate = 0\.5"):
        pl.step([TASK])


# --------------------------------------------------------------------------- evaluation


def test_evaluation_leaves_infra_failures_out_of_n_and_counts_them():
    """Before: an env_lost episode counted as a failed task (n 4, pass rate 0.5)."""
    trajs = [_traj(0, 1.0), _traj(1, 1.0), _traj(2, 0.0), _traj(3, 0.0, infra="sandbox")]
    s = summarize_trajectories(trajs)
    assert (s["n"], s["pass_rate"], s["infra"], len(s["passed"])) == (3, 2 / 3, {"sandbox": 1}, 3)
    assert summarize_trajectories([_traj(0, 0.0, infra="env_lost")])["infra"] == {"env_lost": 1}


def test_paired_comparisons_leave_out_tasks_an_infra_failure_hit_in_either_run():
    """SFT vs expert on the same 4 tasks, task c lost to the sandbox in the expert's run: the pair is over a, b,
    d (before: the expert's summary held c as a failed task)."""
    tasks = [get_family("general.arithmetic").generate(4, seed=1)[i] for i in range(4)]
    before = summarize_trajectories([_traj(i, r, task=t) for i, (t, r) in enumerate(zip(tasks, [1.0, 0.0, 1.0, 0.0]))])
    after = summarize_trajectories([_traj(i, r, task=t, infra="sandbox" if i == 2 else None)
                                    for i, (t, r) in enumerate(zip(tasks, [1.0, 1.0, 0.0, 0.0]))])
    assert paired_passes(before, after) == ([True, False, False], [True, True, False])
    with pytest.raises(ValueError, match="different tasks"):
        paired_passes(before, summarize_trajectories([_traj(0, 1.0, task=tasks[0])]))
