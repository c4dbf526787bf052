"""bench/rl_step.py: TRL's reward function scores a completion exactly as k3post's agent loop
does, and the bench's budget table leaves the verifier's rewards untouched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from k3post.envs.episode import run_episode_sync
from k3post.envs.families import get_family
from k3post.models import build_tiny_moe
from k3post.rewards.effort import EffortConfig, effort_override
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import GenerationResult
from k3post.rollout.evaluation import make_env
from k3post.rollout.trajectory import Trajectory
from k3post.xtml import XTML

_spec = importlib.util.spec_from_file_location("bench_rl_step", Path(__file__).parents[1] / "bench" / "rl_step.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def _completions(xtml: XTML, task) -> dict[str, tuple[list[int], str]]:
    """Sampled ids (after the generation prefix) of: the reference answer, the answer + 1, the
    reference cut before <|end_of_msg|> (a max_tokens stop), and a message with no response
    channel closed (malformed XTML); with the engine's finish reason."""
    fam = get_family(task.family)
    ep = run_episode_sync(fam.reference_policy(task, "max"), fam.make_env(task), task)
    prompt = xtml.render(list(task.messages), effort="max", add_generation_prompt=True).ids

    def sampled(messages) -> list[int]:
        ids = xtml.render(messages, effort="max").ids
        assert ids[: len(prompt)] == prompt
        return ids[len(prompt):]

    ref = sampled(ep.messages)
    wrong = [dict(m) for m in ep.messages]
    wrong[-1]["content"] = str(int(task.metadata["answer"]) + 1)
    return {
        "reference": (ref, "stop"),
        "off_by_one": (sampled(wrong), "stop"),
        "cut": (ref[:-1], "length"),
        "malformed": (ref[:3] + [xtml.eom_id], "stop"),
    }


def test_verifier_reward_matches_the_agent_loop(xtml_tokenizer):
    xtml = XTML(xtml_tokenizer)
    task = get_family(bench.FAMILY).generate(1, seed=5, difficulty=1)[0]
    comps = _completions(xtml, task)
    reward = bench.VerifierReward(xtml)
    got = {k: reward.score(task, ids) for k, (ids, _) in comps.items()}
    # by hand: only the exact integer in the response channel of a finished message earns 1
    assert got == {"reference": 1.0, "off_by_one": 0.0, "cut": 0.0, "malformed": 0.0}

    model = build_tiny_moe(len(xtml_tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, moe_intermediate_size=32, num_experts=2,
                           num_experts_per_tok=1, intermediate_size=32)
    loop = AgentLoop(EmbeddedEngine(model, xtml_tokenizer, max_batch_size=2, max_model_len=512), xtml, make_env, effort="max")
    for name, (ids, finish) in comps.items():
        traj = Trajectory(traj_id=name, group_id=0, sample_index=0, seed=0, task=task.to_dict())
        loop.start(traj)
        res = GenerationResult(AgentLoop.request_id(traj), traj.token_ids[: traj.segment_start], list(ids),
                               [0.0] * len(ids), [0] * len(ids), finish)
        assert loop.finish_turn(traj, res)
        assert traj.reward == got[name], name
    loop.close()


def test_budget_table_never_overrides_up_to_the_cap():
    tasks = get_family(bench.FAMILY).generate(3, seed=1, difficulty=1)
    table = bench.budget_table(tasks, 48)
    assert [table.b0(t) for t in tasks] == [48.0] * 3
    # effort max: limit = min(tau_max, max_cap) * b0 = min(2, 4) * 48 = 96 > 48 >= any T(y) of a step
    r, _ = effort_override([1.0, 0.0, 1.0], [48, 47, 0], [48.0] * 3, "max", "general", EffortConfig())
    assert r.tolist() == [1.0, 0.0, 1.0]


def test_bench_arguments_are_checked(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_step.py", "--k", "1"])
    with pytest.raises(ValueError, match="--k >= 2"):
        bench.main()
