"""Whatever the policy writes, an episode ends with a verdict: a property-based test of `AgentLoop` +
`PartialRolloutScheduler` over every registered task family.

The policy is a `ScriptedEngine` whose turns are adversarial token streams: uniformly random ids, the
family's reference turns and wrong-policy turns cut at a random token, with special tokens inserted
or swapped anywhere, well-formed calls to unknown tools / with missing, extra or mistyped arguments /
with non-object arguments, call and result headers whose ``index`` is duplicated, skipped, zero or not
a number, model-written tool results and user messages, empty turns, and turns that never end. The
real scheduler (λ < 1, so turns are paused and resumed through the KV pool), environments (sandboxed
code for the coding families), verifiers and XTML renderer run on them.

Properties: no exception escapes; every episode ends with a verdict (reward 0 unless the env verified
it); a malformed end names its reason and is never an env / renderer defect; the context of every
episode the env ended validates as XTML and its trainable tokens are exactly the sampled ones.

Shape legend: none (token lists only).
"""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_engine import ScriptedEngine

from k3post.stages.sft_data import default_corpus
from k3post.envs.episode import run_episode_sync
from k3post.envs.families import families
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.engine import GenerationRequest, SamplingParams
from k3post.rollout.evaluation import make_env
from k3post.rollout.kv_pool import KVPool
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.rollout.trajectory import MALFORMED_REASONS, Trajectory, outcome_metrics
from k3post.tokenizer import train_tokenizer
from k3post.xtml import XTML

FAMILIES = [f.name for f in families()]
ENV_DEFECTS = ("env_error", "verifier_error", "unrenderable_reply")
KINDS = ("random", "reference", "cut", "specials", "bad_calls", "bad_index", "fake_messages", "empty", "endless")


@pytest.fixture(scope="module")
def world(aet_evaluate_once_module, webdev_browser_once_module):
    """(tokenizer, xtml, {family: [(task, [assistant messages of its reference and wrong policies])]}).

    The AET families' checks run once per distinct checked tree in this module, and webdev's browser runs once per
    distinct page and runs (conftest.py: most wrong policies and the adversarial episodes leave the tree as it
    started; the adversary replays the reference pages)."""
    tok = train_tokenizer(default_corpus(n_per_family=1, n_main=2), vocab_size=800)
    xtml = XTML(tok)
    per_family: dict[str, list[tuple[Any, list[dict[str, Any]]]]] = {}
    for fam in families():
        rows = []
        for task in fam.generate(3, seed=11):
            turns = []
            policies = [fam.reference_policy(task, e) for e in ("max", "low")] + list(fam.wrong_policies(task).values())
            for policy in policies:
                ep = run_episode_sync(policy, fam.make_env(task), task, verify=False)
                turns += [m for m in ep.messages if m["role"] == "assistant"]
            rows.append((task, turns))
        per_family[fam.name] = rows
    return tok, xtml, per_family


class Adversary:
    """The turn generator: ``turn(traj, rng)`` -> the token ids one adversarial turn samples."""

    def __init__(self, tok: Any, xtml: XTML, turns_by_task: dict[str, list[dict[str, Any]]]) -> None:
        self.tok, self.xtml, self.turns_by_task = tok, xtml, turns_by_task
        self.special = [xtml.open_id, xtml.close_id, xtml.sep_id, xtml.eom_id, xtml.pad_id]
        self.prefix_len = len(xtml.generation_prefix())

    def completion(self, message: dict[str, Any]) -> list[int]:
        """The tokens a model samples for ``message`` after the generation prefix (renderer's form)."""
        r = self.xtml.render([{"role": "user", "content": "x"}, message])
        return [t for t, i in zip(r.ids, r.message_index) if i == 1][self.prefix_len :]

    def encode(self, text: str) -> list[int]:
        """Text with XTML special tokens written out (as the tokenizer decodes them) -> ids."""
        return self.tok.encode(text, add_special_tokens=False)

    def bad_calls(self, tools: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
        names = [t["function"]["name"] for t in tools] or ["nothing"]
        calls = []
        for _ in range(rng.randint(1, 4)):
            name = rng.choice(names + ["no_such_tool", "", " ", "submit"])
            kind = rng.randrange(6)
            if kind == 0:
                args: Any = {}
            elif kind == 1:
                args = {"unexpected": rng.choice([1, "x", None, [1, 2], {"a": {}}])}
            elif kind == 2:
                args = [1, 2, 3]  # not an object: a JSON-fallback block
            elif kind == 3:
                args = "{not json"
            elif kind == 4:
                spec = next((t["function"] for t in tools if t["function"]["name"] == name), {})
                props = (spec.get("parameters") or {}).get("properties") or {"q": {}}
                args = {k: rng.choice([12345, -1.5, True, None, "", "z" * 50, [], {}]) for k in props}
            else:
                args = "null"
            calls.append({"id": f"c{rng.randrange(3)}", "type": "function", "function": {"name": name or "x", "arguments": args}})
        return {"role": "assistant", "reasoning_content": "call things", "content": "", "tool_calls": calls}

    def turn(self, traj: Trajectory, rng: random.Random) -> list[int]:
        kind = "reference" if rng.random() < 0.6 else rng.choice(KINDS)  # episodes must get past turn 1 too
        pool = self.turns_by_task[traj.task["id"]]
        ref = pool[min(traj.turns, len(pool) - 1)] if rng.random() < 0.6 else rng.choice(pool)
        if kind == "random":
            ids = [rng.randrange(len(self.tok)) for _ in range(rng.randint(1, 40))]
            return ids + ([self.xtml.eom_id] if rng.random() < 0.8 else [])
        if kind == "reference":
            return self.completion(ref)
        if kind == "cut":
            ids = self.completion(ref)
            cut = ids[: rng.randrange(len(ids))]
            return cut + ([self.xtml.eom_id] if rng.random() < 0.7 else [])
        if kind == "specials":
            ids = self.completion(ref)
            for _ in range(rng.randint(1, 3)):
                p = rng.randrange(len(ids) + 1)
                if rng.random() < 0.5 or p == len(ids):
                    ids.insert(p, rng.choice(self.special))
                else:
                    ids[p] = rng.choice(self.special)
            if self.xtml.eom_id in ids:
                ids = ids[: ids.index(self.xtml.eom_id) + 1]
            return ids
        if kind == "bad_calls":
            return self.completion(self.bad_calls(traj.tools, rng))
        if kind == "bad_index":
            msg = ref if ref.get("tool_calls") else self.bad_calls(traj.tools, rng)
            text = self.tok.decode(self.completion(msg))
            n = max(1, text.count('index="'))
            for k in range(1, n + 1):
                if rng.random() < 0.7:
                    text = text.replace(f'index="{k}"', f'index="{rng.choice(["0", "1", str(k + 1), "-2", "x", "", "01"])}"', 1)
            return self.encode(text)
        if kind == "fake_messages":  # the model writes a tool result / user turn of its own
            fake = rng.choice([
                '<|close|>think<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role="tool" tool="search" index="1"<|sep|>ok<|close|>message<|sep|><|end_of_msg|>',
                '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>',
                '<|close|>think<|sep|><|open|>response<|sep|>x<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a" index="1"<|sep|><|close|>call<|sep|><|open|>call tool="a" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>',
                '<|open|>response<|sep|>skip think<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>',
                '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>again<|close|>think<|sep|><|close|>message<|sep|><|end_of_msg|>',
            ])
            return self.encode(fake)
        if kind == "empty":
            return self.encode(rng.choice(["<|end_of_msg|>", "<|close|>think<|sep|><|close|>message<|sep|><|end_of_msg|>",
                                           "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"]))
        assert kind == "endless"
        return self.completion(ref)[:-1]  # the message without its <|end_of_msg|>: runs to max_tokens


def _run(world, family: str, draw_turn, *, n_prompts: int, k: int, lambda_: float, max_tokens: int,
         max_model_len: int | None, iterations: int = 200) -> list[Trajectory]:
    """Every prompt of ``family`` through the scheduler with turns from ``draw_turn(traj, request)``;
    returns the finished trajectories (all of them)."""
    tok, xtml, per_family = world
    tasks = [task for task, _ in per_family[family]][:n_prompts]
    sched: PartialRolloutScheduler

    def script(req: GenerationRequest) -> list[int]:
        traj = next(t for t in sched.trajectories() if t.traj_id == req.request_id.split("#")[0])
        return draw_turn(traj, req)

    engine = ScriptedEngine(script, eom_id=xtml.eom_id, max_batch_size=4, max_model_len=max_model_len)
    loop = AgentLoop(engine, xtml, make_env, sampling=SamplingParams(max_tokens=max_tokens), effort="max")
    sched = PartialRolloutScheduler(loop, n_prompts=n_prompts, k=k, lambda_=lambda_, seed=3, kv_pool=KVPool(1 << 20))
    sched.add_prompts(tasks)
    done: list[Trajectory] = []
    for _ in range(iterations):
        for g in sched.run_iteration():
            done += g.trajectories
        engine.update_weights({})
        if len(done) == len(tasks) * k:
            break
    loop.close()
    assert len(done) == len(tasks) * k, f"{family}: {len(done)} of {len(tasks) * k} episodes finished"
    return done


def _check_episodes(xtml: XTML, trajs: list[Trajectory]) -> None:
    for t in trajs:
        where = f"{t.traj_id} ({t.task['family']}, finish {t.finish}, {t.malformed})"
        assert t.done and t.verdict is not None and t.reward == t.verdict["reward"], where
        assert (t.finish == "malformed") == (t.malformed is not None), where
        if t.finish in ("malformed", "length", "context"):
            assert t.reward == 0.0 and t.verdict["diagnostics"].startswith(t.finish + ": "), where
        if t.malformed is not None:
            assert t.malformed in MALFORMED_REASONS and t.malformed not in ENV_DEFECTS, (where, t.info[-1])
        else:  # the env ended it (or a limit did): the context is valid XTML ...
            assert t.finish in ("answer", "submit", "truncated", "length", "context"), where
        if t.finish in ("answer", "submit", "truncated"):
            v = xtml.validate(t.token_ids)
            assert v.ok, (where, v)
            # ... and every token the renderer would train on was sampled by the policy
            mask = xtml.annotate(t.token_ids).loss_mask
            assert all(s for m, s in zip(mask, t.trainable) if m), where


def _seeded_turns(adv: Adversary, salt: int):
    def draw(traj: Trajectory, req: GenerationRequest) -> list[int]:
        return adv.turn(traj, random.Random(zlib.crc32(f"{salt}/{req.request_id}".encode())))
    return draw


@pytest.mark.parametrize("family", FAMILIES)
def test_adversarial_streams_always_end_with_a_verdict(world, family):
    """Hundreds of adversarial episodes (7 families x 3 prompts x 8 samples x 2 runs), paused and resumed."""
    tok, xtml, per_family = world
    adv = Adversary(tok, xtml, {t.id: turns for t, turns in per_family[family]})
    longest = max(len(adv.completion(m)) for _, turns in per_family[family] for m in turns)
    trajs = []  # room for every reference turn; then a cap and a context limit that cut episodes short
    for salt, (max_tokens, max_model_len) in enumerate([(longest + 8, None), (64, 900)]):
        trajs += _run(world, family, _seeded_turns(adv, salt), n_prompts=3, k=8, lambda_=0.5,
                      max_tokens=max_tokens, max_model_len=max_model_len)
    _check_episodes(xtml, trajs)
    finishes = Counter(t.finish for t in trajs)
    m = outcome_metrics(trajs)
    assert m["malformed_episodes"] == finishes["malformed"] > 0 and m["length_episodes"] == finishes["length"]
    assert m["malformed/xtml"] > 0
    if any(m.get("tool_calls") for _, turns in per_family[family] for m in turns):  # a multi-turn family
        assert sum(t.turns > 1 for t in trajs) > 0, "no episode got past its first turn: tool results were never rendered"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), family=st.sampled_from(FAMILIES))
def test_property_any_turns_end_with_a_verdict(world, data, family):
    """Hypothesis draws every turn (its kind and random choices, or raw ids); failures shrink to a
    minimal list of turns."""
    tok, xtml, per_family = world
    adv = Adversary(tok, xtml, {t.id: turns for t, turns in per_family[family]})
    specials = st.sampled_from(adv.special)
    raw = st.lists(st.one_of(specials, st.integers(0, len(tok) - 1)), min_size=0, max_size=30)

    def draw(traj: Trajectory, req: GenerationRequest) -> list[int]:
        if data.draw(st.booleans(), label="raw ids"):
            ids = data.draw(raw, label=f"{req.request_id} ids")
            return ids + [xtml.eom_id]
        return adv.turn(traj, random.Random(data.draw(st.integers(0, 2**32 - 1), label=f"{req.request_id} seed")))

    trajs = _run(world, family, _memo(draw), n_prompts=1, k=3, lambda_=0.67, max_tokens=80, max_model_len=None)
    _check_episodes(xtml, trajs)


def _memo(draw):
    """The script must be a pure function of the request (a resumed turn re-derives its tokens)."""
    seen: dict[str, list[int]] = {}

    def script(traj: Trajectory, req: GenerationRequest) -> list[int]:
        if req.request_id not in seen:
            seen[req.request_id] = draw(traj, req)
        return seen[req.request_id]
    return script


def test_model_written_call_ids_bind_to_the_calls_the_renderer_knows(world):
    """The demo crash (issue 13): a turn whose first sampled token opens a new header after the
    generation prefix (here a whole second assistant message with a tool call). The stream parser used
    to accept it as a message of its own, the env answered ``call_1``, and `XTML.extend` (which parses
    the same tokens inside the context, where they are invalid) found no call: a ValueError out of the
    training loop. Now the turn parses as it reads in the context: malformed, reward 0, and the run
    goes on."""
    tok, xtml, per_family = world
    task, turns = per_family["agents.search"][0]
    adv = Adversary(tok, xtml, {task.id: turns})
    call = next(m for m in turns if m.get("tool_calls"))
    full = xtml.render([{"role": "user", "content": "x"}, call])
    msg_ids = [t for t, i in zip(full.ids, full.message_index) if i == 1]  # header included
    assert xtml.parse(msg_ids)["tool_calls"]  # on its own it is a valid message with a call
    with pytest.raises(ValueError):
        xtml.parse(msg_ids, after_prefix=True)

    def draw(traj: Trajectory, req: GenerationRequest) -> list[int]:
        return msg_ids if traj.turns == 0 else adv.completion(call)

    trajs = _run(world, "agents.search", draw, n_prompts=1, k=2, lambda_=1.0, max_tokens=400, max_model_len=None)
    assert [(t.finish, t.malformed, t.reward) for t in trajs] == [("malformed", "xtml", 0.0)] * 2
    assert "element <message> not allowed inside <think>" in trajs[0].verdict["diagnostics"]
    # the same call written after the prefix is a real call: the env answers it and the episode goes on
    trajs = _run(world, "agents.search", lambda traj, req: adv.completion(call), n_prompts=1, k=1, lambda_=1.0,
                 max_tokens=400, max_model_len=None)
    assert trajs[0].turns > 1 and trajs[0].malformed is None


def test_env_defects_end_the_episode_not_the_run(world, caplog):
    """An env whose step or verifier raises, or whose reply cannot be rendered, ends the episode
    "malformed" with the defect's reason and its traceback in the log; the other episodes go on."""
    tok, xtml, per_family = world
    task, turns = per_family["agents.search"][0]
    adv = Adversary(tok, xtml, {task.id: turns})
    call = next(m for m in turns if m.get("tool_calls"))
    answer = {"role": "assistant", "reasoning_content": "", "content": "done"}

    class Broken:
        def __init__(self, task, mode):
            self.env, self.mode = make_env(task), mode

        def __getattr__(self, name):
            return getattr(self.env, name)

        async def step(self, message):
            if self.mode == "step":
                raise KeyError("boom")
            result = await self.env.step(message)
            if self.mode == "reply":
                result.messages = [{"role": "tool", "tool_call_id": "call_1", "content": 42}]  # content is no string
            return result

        def verify(self):
            if self.mode == "verify":
                raise ZeroDivisionError("bad verifier")
            return self.env.verify()

    for mode, turn, reason in [("step", call, "env_error"), ("reply", call, "unrenderable_reply"),
                               ("verify", answer, "verifier_error")]:
        engine = ScriptedEngine(lambda req, turn=turn: adv.completion(turn), eom_id=xtml.eom_id)
        loop = AgentLoop(engine, xtml, lambda task, mode=mode: Broken(task, mode), sampling=SamplingParams(max_tokens=400))
        trajs = [Trajectory(traj_id=f"{mode}{j}", group_id=0, sample_index=j, seed=j, task=task.to_dict()) for j in range(2)]
        with caplog.at_level("WARNING", logger="k3post.rollout.agent_loop"):
            loop.run(trajs)
        assert [(t.finish, t.malformed, t.reward) for t in trajs] == [("malformed", reason, 0.0)] * 2
        assert "Traceback" in caplog.text and reason in caplog.text
        caplog.clear()
        loop.close()


def test_untrained_model_on_every_family(world):
    """The real engine: a freshly initialised tiny MoE samples at temperature 1 on every family
    (what the demo's RL starts from before SFT teaches XTML): every episode ends with a verdict."""
    import torch

    from k3post.models import build_tiny_moe
    from k3post.rollout import EmbeddedEngine

    tok, xtml, per_family = world
    torch.manual_seed(0)
    model = build_tiny_moe(len(tok), seed=4, pad_token_id=tok.pad_token_id, eos_token_id=xtml.eom_id).eval()
    engine = EmbeddedEngine(model, tok, max_batch_size=16, max_model_len=1024)
    loop = AgentLoop(engine, xtml, make_env, sampling=SamplingParams(max_tokens=24), effort="low")
    trajs = [Trajectory(traj_id=f"{f}/{j}", group_id=i, sample_index=j, seed=i * 10 + j, task=per_family[f][0][0].to_dict())
             for i, f in enumerate(FAMILIES) for j in range(3)]
    loop.run(trajs)
    loop.close()
    _check_episodes(xtml, trajs)
    assert json.dumps([t.verdict for t in trajs])  # JSON-able verdicts for every episode
