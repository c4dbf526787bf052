"""bench/rl_step.py: TRL's reward function scores a completion exactly as k3post's agent loop
does, and the bench's budget table leaves the verifier's rewards untouched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

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


def _tiny_model(tok):
    return build_tiny_moe(len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
                          intermediate_size=32, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id)


def test_trl_arm_runs_k3post_compute_settings(xtml_tokenizer, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]'): the bench's TRL arm is not built")
    args = bench.parse_args([])
    cfg = bench.trl_config(args, str(tmp_path))
    # the compute graph: no recomputation in the backward, fp32 (no bf16 / fp16 mixed precision), no compile
    assert cfg.gradient_checkpointing is False and getattr(cfg, "activation_checkpointing", False) is False
    assert cfg.bf16 is False and cfg.fp16 is False and cfg.torch_compile is False
    # one optimizer step per generation batch of N*K completions; no old-log-prob or reference-model forward
    assert cfg.per_device_train_batch_size == cfg.generation_batch_size == args.n * args.k
    assert (cfg.gradient_accumulation_steps, cfg.steps_per_generation, cfg.num_iterations, cfg.beta) == (1, 1, 1, 0.0)
    # k3post's loss: token mean over every sampled token of the step; A = r - group mean without std division
    assert cfg.loss_type == "dapo" and cfg.scale_rewards == "none" and cfg.mask_truncated_completions is False
    assert cfg.importance_sampling_level == "token" and cfg.top_entropy_quantile == 1.0 and cfg.entropy_coef == 0.0
    # sampling and optimizer as k3post's RLConfig in the bench
    rl = bench.rl_config(args)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_completion_length) == (rl.rollout.temperature, 1.0, 0, rl.rollout.max_tokens)
    assert (cfg.learning_rate, cfg.adam_beta1, cfg.adam_beta2, cfg.weight_decay, cfg.max_grad_norm) == (
        rl.optim.lr, 0.9, 0.95, rl.optim.weight_decay, rl.optim.grad_clip)
    assert cfg.lr_scheduler_type == "constant" and cfg.router_aux_loss_coef == 0.0 and not cfg.use_vllm
    assert bench.trl_config_dict(cfg)["gradient_checkpointing"] is False  # the JSON-able copy the bench prints

    # what the built trainer actually runs (TRL defaults bf16 to True when it is left unset)
    xtml = XTML(xtml_tokenizer)
    tasks = get_family(bench.FAMILY).generate(args.n, seed=1, difficulty=1)
    prompts = [xtml_tokenizer.decode(xtml.render(list(t.messages), effort="max", add_generation_prompt=True).ids)
               for t in tasks]
    trainer = bench.build_trl(_tiny_model(xtml_tokenizer), xtml_tokenizer, prompts, tasks, args, str(tmp_path), [])
    assert trainer.accelerator.mixed_precision == "no"
    assert not bench.checkpointing(trainer.model)
    m = trainer.model  # the check sees TRL's default when it is on
    (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
    assert bench.checkpointing(m)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert trainer.ref_model is None


def test_k3post_arm_trains_zero_variance_groups(xtml_tokenizer, one_torch_thread):
    # untrained model, 8-token cap: every completion is cut or malformed, reward 0, so every group has zero variance
    args = bench.parse_args(["--n", "2", "--k", "2", "--max-tokens", "8", "--steps", "3", "--warmup", "0"])
    tasks = bench.train_tasks([bench.FAMILY], args.n * bench.rounds(args), difficulty=1, seed=0)
    budgets = bench.budget_table(tasks, args.max_tokens)
    equal = bench.K3PostArm("k3post", _tiny_model(xtml_tokenizer), xtml_tokenizer, bench.rl_config(args), budgets, tasks)
    skip = bench.K3PostArm("skip", _tiny_model(xtml_tokenizer), xtml_tokenizer,
                           bench.rl_config(args, skip_zero_variance=True), budgets, tasks)
    try:
        assert equal.step() > 0 and skip.step() > 0
    finally:
        equal.close()
        skip.close()
    r, s = equal.rec[0], skip.rec[0]
    assert r["zero_variance_groups"] == r["groups"] == 2
    # the headline arm trains every group, zero-variance ones included, on all N*K sequences (TRL's work)...
    assert r["trained_groups"] == r["groups"] and r["trained_seqs"] == r["completions"] == 4
    assert r["trained_tokens"] == r["tokens"] > 0 and r["forward_s"] > 0 and r["optimizer_s"] > 0
    # ... the skipping arm none of them
    assert s["trained_groups"] == 0 and s["trained_seqs"] == 0 and s["forward_s"] == 0
