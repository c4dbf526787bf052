"""Tests of k3post.rollout.agent_loop: multi-turn agentic episodes on the embedded engine.

The policy is a real tiny Qwen3-MoE that memorises ONE reference trajectory of
``agents.search`` (5 turns with search / open / submit tool calls) in a few seconds of
AdamW, so the loop meets real tool calls, real tool results from the real environment and a
real verifier. Checks: the episode reproduces the reference context token for token (the
sampled tokens kept, tool results appended by XTML.extend), the trainable mask equals the
renderer's loss mask, behaviour log-probs equal a plain HF forward over the final context
within 1e-5 at every sampled position, versions / env tokens are stamped correctly, token
accounting (SPEC §3.3), malformed output ends an episode with reward 0 (no crash), and a
paused multi-turn episode resumes from its saved env state in a new process-like setup.

Shape legend: T context tokens, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from k3post.stages.sft_data import default_corpus
from k3post.envs.episode import run_episode_sync
from k3post.envs.families.registry import get_family
from k3post.envs.tools import openai_tools
from k3post.models import build_tiny_moe
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.trajectory import Trajectory
from k3post.tokenizer import train_tokenizer
from k3post.xtml import EOM, XTML

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _env_factory(task):
    """A fresh env of the task's own family (so one run can mix families)."""
    return get_family(task.family).make_env(task)


@pytest.fixture(scope="module")
def memorised():
    """(model, tokenizer, xtml, task, reference ids, reference loss mask): a small tiny-MoE
    trained until greedy decoding reproduces every assistant token of one agents.search
    reference trajectory (teacher-forced argmax accuracy 1.0 on the loss-masked tokens)."""
    tok = train_tokenizer(default_corpus(n_per_family=2, n_main=4), vocab_size=1024)
    xtml = XTML(tok)
    fam = get_family("agents.search")
    task = fam.generate(1, seed=0)[0]
    env = fam.make_env(task)
    ep = run_episode_sync(fam.reference_policy(task, "low"), env, task)
    assert ep.reward == 1.0 and ep.turns == 5
    ref = xtml.render(ep.messages, tools=openai_tools(env.tool_specs()))
    model = build_tiny_moe(
        len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM),
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        moe_intermediate_size=64, num_experts=4, intermediate_size=128,
    )
    ids_1T = torch.tensor(ref.ids)[None]
    mask_T = torch.tensor(ref.loss_mask)
    labels_1T = ids_1T.clone()
    labels_1T[0, ~mask_T] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    m_T = mask_T[1:]
    target_T = ids_1T[0, 1:]

    def margin() -> tuple[float, float]:
        """(smallest logit margin of the reference token over the runner-up at a trainable position, loss)
        of the model as it is now (eval forward): > 0 means greedy decoding reproduces every sampled token."""
        model.eval()
        with torch.no_grad():
            out = model(ids_1T, labels=labels_1T)
        model.train()
        logits_TV = out.logits[0, :-1][m_T].float()
        ref_T = logits_TV.gather(1, target_T[m_T][:, None])[:, 0]
        other_T = logits_TV.scatter(1, target_T[m_T][:, None], float("-inf")).amax(-1)
        return float((ref_T - other_T).min()), float(out.loss)

    model.train()
    gap, loss = margin()
    for step in range(300):
        for g in opt.param_groups:
            g["lr"] = 1e-2 * min(1.0, (step + 1) / 10)
        out = model(ids_1T, labels=labels_1T)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 5 == 4:
            gap, loss = margin()
            # a margin of 2 nats: greedy decoding does not depend on the CPU's last bits, and peaked enough
            # to sample at temperature < 1 (checked on the model as it is after the step)
            if gap > 2.0 and loss < 0.05:
                break
    model.eval()
    assert gap > 2.0, f"memorisation failed (smallest margin {gap:.3f}, loss {loss:.4f})"
    return model, tok, xtml, task, ref.ids, ref.loss_mask


def _traj(task, gid: int = 0, j: int = 0, seed: int = 0) -> Trajectory:
    return Trajectory(traj_id=f"g{gid}/s{j}", group_id=gid, sample_index=j, seed=trajectory_seed(seed, gid, j), task=task.to_dict())


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from a plain HF forward, [T-1]."""
    with torch.no_grad():
        logits_TV = model(torch.tensor(ids)[None]).logits[0].float()
    return torch.log_softmax(logits_TV[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_greedy_episode_reproduces_reference_context(memorised):
    model, tok, xtml, task, ref_ids, ref_mask = memorised
    engine = EmbeddedEngine(model, tok, max_batch_size=4)
    loop = AgentLoop(engine, xtml, _env_factory, sampling=SamplingParams(temperature=0.0, max_tokens=96))
    (traj,) = loop.run([_traj(task)])
    assert traj.done and traj.finish == "submit" and traj.reward == 1.0 and traj.turns == 5
    assert traj.verdict is not None and traj.verdict["reward"] == 1.0
    # the sampled tokens are kept and tool results appended without re-rendering: the whole
    # context equals the renderer's output for the reference transcript, token for token
    # (the reference also renders the final "Submitted." tool message the episode ends on)
    n = len(traj.token_ids)
    assert traj.token_ids == ref_ids[:n] and traj.token_ids[-1] == xtml.eom_id
    assert xtml.tokenizer.decode(ref_ids[n:]).startswith('<|open|>message role="tool"')
    assert traj.trainable == ref_mask[:n]
    sampled = [i for i, m in enumerate(traj.trainable) if m]
    env_pos = [i for i, m in enumerate(traj.trainable) if not m]
    assert all(traj.versions[i] == 0 for i in sampled)
    assert all(traj.versions[i] == -1 and traj.logprobs[i] == 0.0 for i in env_pos)
    # SPEC §3.3 accounting: every sampled token is an output token (tool-call arguments
    # included); at effort "low" the think channel is empty, so each turn's first sampled
    # token closes it and no thinking token is counted
    assert traj.output_tokens == len(sampled) == traj.num_sampled
    assert traj.thinking_tokens == 0
    assert traj.effort_tokens() == traj.output_tokens  # agents domain counts all output tokens
    assert traj.env_state is None and loop._envs == {}  # env released when done


def test_sampled_logprobs_match_hf_forward_over_final_context(memorised):
    model, tok, xtml, task, _, _ = memorised
    engine = EmbeddedEngine(model, tok, max_batch_size=3)
    # temperature 0.7 with a 0.9 nucleus: the memorised tool calls survive sampling; the
    # recorded log-probs are always those of the raw (temperature 1, unfiltered) distribution
    loop = AgentLoop(engine, xtml, _env_factory, sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=96))
    trajs = loop.run([_traj(task, 0, j) for j in range(4)])
    for traj in trajs:
        assert traj.done
        hf_T = _hf_logprobs(model, traj.token_ids)
        sampled = [i for i, m in enumerate(traj.trainable) if m]
        assert sampled and sampled[0] == traj.prompt_len
        got = torch.tensor([traj.logprobs[i] for i in sampled], dtype=torch.float32)
        want = hf_T[torch.tensor(sampled) - 1]
        assert float((got - want).abs().max()) < TOL
        # thinking tokens: per turn, sampled tokens before the first <|close|> of that turn
        n_think, in_think = 0, False
        for i, m in enumerate(traj.trainable):
            if m and (i == 0 or not traj.trainable[i - 1]):
                in_think = True
            if m and in_think:
                if traj.token_ids[i] == xtml.close_id:
                    in_think = False
                else:
                    n_think += 1
        assert traj.thinking_tokens == n_think
    # the memorised policy, sampled, still solves the task with tool calls
    # (a sample that strays is malformed or wrong and gets 0: also fine)
    assert any(t.reward == 1.0 and t.turns == 5 for t in trajs), [(t.finish, t.turns) for t in trajs]


def test_malformed_output_ends_episode_with_zero_reward(memorised):
    model, tok, xtml, task, _, _ = memorised
    untrained = build_tiny_moe(len(tok), seed=5, pad_token_id=tok.pad_token_id).eval()
    engine = EmbeddedEngine(untrained, tok, max_batch_size=4)
    # stopping on any structural token makes the untrained model end turns mid-element
    stops = (xtml.eom_id, xtml.sep_id, xtml.close_id)
    loop = AgentLoop(engine, xtml, _env_factory, sampling=SamplingParams(max_tokens=40, stop_ids=stops))
    trajs = loop.run([_traj(task, 0, j) for j in range(4)])
    assert all(t.done and t.reward == 0.0 for t in trajs)
    assert {t.finish for t in trajs} <= {"malformed", "length", "answer", "submit", "truncated"}
    assert any(t.finish == "malformed" for t in trajs)
    for t in trajs:
        assert t.verdict is not None and t.verdict["reward"] == 0.0
        if t.finish == "malformed":
            assert t.malformed == "xtml" and t.info[-1]["error"].startswith("xtml: turn ")
            assert t.verdict["diagnostics"].startswith("malformed: xtml: turn ")
    # a turn cut by max_tokens without <|end_of_msg|> ends the episode as "length", with a verdict
    loop = AgentLoop(engine, xtml, _env_factory, sampling=SamplingParams(max_tokens=5, stop_ids=()))
    (t,) = loop.run([_traj(task, 1, 0)])
    assert t.finish == "length" and t.reward == 0.0 and t.output_tokens == 5 and t.malformed is None
    assert t.verdict == {"reward": 0.0, "components": {"length": 1.0},
                         "diagnostics": "length: turn 0 reached max_tokens (5 tokens) without <|end_of_msg|>"}


def test_paused_multi_turn_episode_resumes_after_restart(memorised, tmp_path):
    """A search episode paused between / inside turns (its env state saved) is restored into a
    new engine, loop and scheduler and finishes exactly like an uninterrupted run."""
    model, tok, xtml, task, ref_ids, ref_mask = memorised
    quick = get_family("general.arithmetic").generate(1, seed=3)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=96)
    assert _turn_lengths(ref_mask)[0] > 8

    def capped(traj, turn):  # the arithmetic episode ends within 8 tokens, whatever the model writes for it
        return SamplingParams(temperature=0.0, max_tokens=8 if traj.task["family"] == "general.arithmetic" else 96)

    def scheduler():
        engine = EmbeddedEngine(model, tok, max_batch_size=4)
        loop = AgentLoop(engine, xtml, _env_factory, sampling=sampling, sampling_fn=capped)
        return PartialRolloutScheduler(loop, n_prompts=2, k=1, lambda_=0.5, kv_pool=KVPool(1 << 24))

    first = scheduler()
    groups = first.run_iteration([quick, task])
    assert [g.task["family"] for g in groups] == ["general.arithmetic"]
    (paused,) = first.paused()
    assert paused.task["family"] == "agents.search" and paused.env_state is not None
    assert len(paused.token_ids) < len(ref_ids)
    first.save(tmp_path / "rollout.json")
    del first

    second = scheduler()
    second.load(tmp_path / "rollout.json")
    out = []
    while second.trajectories():
        out += second.run_iteration()
    (g,) = out
    (traj,) = g.trajectories
    assert traj.reward == 1.0 and traj.finish == "submit" and traj.turns == 5 and traj.pauses >= 1
    assert traj.token_ids == ref_ids[: len(traj.token_ids)]  # identical to the uninterrupted episode


def test_lambda_one_multi_turn_equals_synchronous(memorised):
    model, tok, xtml, task, _, _ = memorised
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=96)
    sync = AgentLoop(EmbeddedEngine(model, tok, max_batch_size=4), xtml, _env_factory, sampling=sampling)
    ref = sync.run([_traj(task, 0, j, seed=7) for j in range(3)])
    loop = AgentLoop(EmbeddedEngine(model, tok, max_batch_size=2), xtml, _env_factory, sampling=sampling)
    sch = PartialRolloutScheduler(loop, n_prompts=1, k=3, lambda_=1.0, seed=7)
    (g,) = sch.run_iteration([task])
    assert sch.stats["kv_turn_hits"] > 0  # later turns started from the previous turn's KV
    for a, b in zip(g.trajectories, ref):
        assert a.token_ids == b.token_ids and a.trainable == b.trainable and a.reward == b.reward
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL


def test_agent_loop_validation(memorised):
    model, tok, xtml, task, _, _ = memorised
    engine = EmbeddedEngine(model, tok)
    with pytest.raises(ValueError, match="SteppableEngine"):
        AgentLoop(object(), xtml, _env_factory)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        AgentLoop(engine, xtml, _env_factory, mode="chat")
    loop = AgentLoop(engine, xtml, _env_factory)
    t = _traj(task)
    loop.start(t)
    with pytest.raises(ValueError, match="already started"):
        loop.start(t)
    lost = Trajectory.from_dict({**t.to_dict(), "traj_id": "g9/s0"})
    with pytest.raises(ValueError, match="no live environment"):
        loop.env(lost)


def test_multi_turn_kv_reuse_prefills_only_tails_same_trajectories(memorised):
    """Each later turn starts from the KV its previous turn left in the engine: far fewer
    prefilled tokens, and the same trajectories (tokens, masks, rewards, log-probs) as
    re-prefilling the whole context every turn."""
    model, tok, xtml, task, _, _ = memorised
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=96)
    trajs = {}
    engines = {}
    for reuse in (False, True):
        engine = EmbeddedEngine(model, tok, max_batch_size=4)
        loop = AgentLoop(engine, xtml, _env_factory, sampling=sampling, reuse_kv=reuse)
        assert loop.reuse_kv is reuse
        trajs[reuse] = loop.run([_traj(task, 0, j, seed=11) for j in range(3)])
        engines[reuse] = engine
        assert engine.num_kept_kv == 0 and loop._turn_kv == {}  # nothing leaks
    for a, b in zip(trajs[True], trajs[False]):
        assert a.token_ids == b.token_ids and a.trainable == b.trainable and a.reward == b.reward
        assert a.turns == b.turns and a.finish == b.finish
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL
    multi_turn = sum(t.turns for t in trajs[True] if t.turns > 1)
    assert multi_turn > 0
    fresh, reused = engines[False].stats, engines[True].stats
    assert reused["kv_reused_tokens"] > 0 and reused["kv_kept"] >= multi_turn
    assert reused["prefill_tokens"] < fresh["prefill_tokens"] / 2
    assert reused["decode_tokens"] == fresh["decode_tokens"]


def _turn_lengths(mask: list[bool]) -> list[int]:
    """Sampled tokens of each assistant turn (the runs of the loss mask)."""
    runs, n = [], 0
    for m in [*mask, False]:
        if m:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def test_paused_between_turns_keeps_turn_kv_in_the_pool(memorised):
    """A trajectory paused after a finished turn, before its next turn was submitted, moves that
    turn's KV into the CPU pool; its resume prefetches it (a pool hit, tail-only prefill) and the
    episodes equal the uninterrupted synchronous ones.

    Built, not hoped for: two prompts of the memorised task, one sample each, λ = 0.5 (the iteration
    ends at the first completed episode), greedy. Both start in the same engine step; g1's first turn is
    the reference's, L tokens ending in <|end_of_msg|>; g0's first turn is capped at L tokens, so it
    ends ("length", its <|end_of_msg|> not a stop) in the same step, which completes the iteration while g1
    has just finished a turn."""
    model, tok, xtml, task, _, ref_mask = memorised
    first_turn = _turn_lengths(ref_mask)[0]

    def cap(traj, turn):  # g0's first turn: L tokens, its <|end_of_msg|> not a stop: it ends "length"
        if traj.group_id == 0 and turn == 0:
            return SamplingParams(temperature=0.0, max_tokens=first_turn, stop_ids=())
        return SamplingParams(temperature=0.0, max_tokens=96)

    def loop(slots):
        return AgentLoop(EmbeddedEngine(model, tok, max_batch_size=slots), xtml, _env_factory,
                         sampling=SamplingParams(temperature=0.0, max_tokens=96), sampling_fn=cap)

    ref = loop(4).run([_traj(task, g, 0, seed=3) for g in range(2)])
    assert [(t.finish, t.turns) for t in ref] == [("length", 0), ("submit", 5)]
    pool = KVPool(1 << 30)
    sch = PartialRolloutScheduler(loop(4), n_prompts=2, k=1, lambda_=0.5, seed=3, kv_pool=pool)
    g0 = sch.run_iteration([task, task])
    assert [g.group_id for g in g0] == [0]
    (paused,) = sch.paused()
    assert paused.group_id == 1 and paused.turns == 1 and paused.segment_start == len(paused.token_ids)
    assert sch.stats["kv_turn_pooled"] == 1 and len(pool) == 1
    groups = list(g0)
    while sch.trajectories():
        groups += sch.run_iteration()
    s = sch.stats
    assert s["kv_pool_hits"] == 1 and s["kv_misses"] == 0 and s["kv_turn_hits"] == 3  # turns 3-5 reuse the engine's KV
    got = {t.traj_id: t for g in groups for t in g.trajectories}
    for b in ref:
        a = got[b.traj_id]
        assert a.token_ids == b.token_ids and a.trainable == b.trainable and a.reward == b.reward
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL
