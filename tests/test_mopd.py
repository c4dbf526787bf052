"""Stage 3 MOPD (k3post/stages/mopd.py): the teacher's context, the teacher pool, the OPD signal, the run, the checks.

Models are tiny Qwen3-MoEs at random init: the student at the default init (near-uniform next-token
distributions), teachers from other seeds with a larger init (initializer_range 0.1: sharper, clearly
different distributions), so the teacher − student log-prob gap is large and distillation has somewhere to go.

Shape legend: T context tokens, V vocabulary.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from k3post.envs.episode import run_episode_sync
from k3post.envs.families.registry import get_family
from k3post.envs.tools import openai_tools
from k3post.models import build_tiny_moe, save_model
from k3post.config.mopd import MOPDConfig
from k3post.rollout.teachers import TeacherPool
from k3post.stages.mopd import (
    effort_sampler, evaluate_mopd, initial_messages, mopd_checks, opd_signal, teacher_context,
    train_mopd,
)
from k3post.config.rl import RLConfig
from k3post.rollout.agent_loop import AgentLoop, trajectory_seed
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.engine import SamplingParams, request_seed, token_uniform
from k3post.rollout.evaluation import make_env
from k3post.rollout.trajectory import Group, Trajectory
from k3post.xtml import OMIT_EFFORT, XTML

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             moe_intermediate_size=64, num_experts=4, intermediate_size=128)


def _model(tok, seed: int = 0, **kw):
    return build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id, **_TINY, **kw)


@pytest.fixture(scope="module")
def folders(xtml_tokenizer, tmp_path_factory):
    """Saved model folders: "student" (seed 0, default init), "t1" and "t2" (seeds 1, 2, init 0.1)."""
    root = tmp_path_factory.mktemp("models")
    out = {"student": str(save_model(_model(xtml_tokenizer, 0), root / "student"))}
    for s in (1, 2):
        out[f"t{s}"] = str(save_model(_model(xtml_tokenizer, s, initializer_range=0.1), root / f"t{s}"))
    return out


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]) for p = 0..T-1 (0.0 at p = 0) from a plain HF forward of one sequence."""
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return [0.0] + [float(logp_TV[p - 1, ids[p]]) for p in range(1, len(ids))]


def _rollout(model, tok, tasks, *, effort_fn, k: int, max_tokens: int = 16) -> list[Group]:
    """K sampled trajectories per task through the real agent loop, as finished groups."""
    loop = AgentLoop(EmbeddedEngine(model, tok), XTML(tok), make_env,
                     sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens), effort_fn=effort_fn)
    groups = []
    for i, task in enumerate(tasks):
        trajs = [Trajectory(traj_id=f"g{i}/s{j}", group_id=i, sample_index=j, seed=trajectory_seed(5, i, j),
                            task=task.to_dict()) for j in range(k)]
        loop.run(trajs)
        groups.append(Group(i, task.to_dict(), trajs))
    loop.close()
    return groups


# --------------------------------------------------------------------------- effort per prompt


def test_effort_sampler_is_a_pure_function_of_the_task_and_seed():
    """mix {low: 1, high: 1, max: 2} → cumulative bounds 0.25, 0.5, 1.0 in the order low, high, max:
    u < 0.25 → low, 0.25 ≤ u < 0.5 → high, else max; u = token_uniform(request_seed(seed, hash), 0)."""
    tasks = get_family("general.arithmetic").generate(400, seed=11)
    fn = effort_sampler({"max": 2.0, "low": 1.0, "high": 1.0}, seed=3)
    got = [fn(t) for t in tasks]
    for t, e in zip(tasks, got):
        u = token_uniform(request_seed(3, t.content_hash()), 0)
        assert e == ("low" if u < 0.25 else "high" if u < 0.5 else "max")
    assert got == [effort_sampler({"low": 1, "high": 1, "max": 2}, seed=3)(t) for t in tasks]  # pure: a new sampler agrees
    share = {e: got.count(e) / len(got) for e in ("low", "high", "max")}
    assert share["low"] == pytest.approx(0.25, abs=0.07) and share["max"] == pytest.approx(0.5, abs=0.07)
    assert [fn(t) for t in tasks] != [effort_sampler({"low": 1, "high": 1, "max": 2}, seed=4)(t) for t in tasks]
    assert {effort_sampler({"high": 1.0, "low": 0.0}, seed=0)(t) for t in tasks[:50]} == {"high"}
    for bad in ({"medium": 1.0}, {"low": 0.0}, {"low": -1.0, "max": 2.0}, {"low": math.nan}):
        with pytest.raises(ValueError, match="effort_mix"):
            effort_sampler(bad, seed=0)


# --------------------------------------------------------------------------- the teacher's context


def test_teacher_context_drops_only_the_effort_message(xtml_tokenizer):
    """A real multi-turn agents.search episode (tool calls, tool results) rendered as the student saw it at
    effort "high": the teacher's context is the same conversation without the thinking-effort message,
    i.e. [tool-declare] + [effort message] + rest  →  [tool-declare] + rest, and every token after the
    student's prompt sits at its position + offset, offset = −len(effort message)."""
    x = XTML(xtml_tokenizer)
    fam = get_family("agents.search")
    task = fam.generate(1, seed=0)[0]
    env = fam.make_env(task)
    ep = run_episode_sync(fam.reference_policy(task, "low"), env, task)
    assert ep.turns == 5
    tools = openai_tools(env.tool_specs())
    messages = initial_messages(task)
    assert messages == ep.messages[: len(messages)]
    full = x.render(ep.messages, tools=tools, effort="high")
    prompt_len = len(x.render(messages, tools=tools, effort="high", add_generation_prompt=True).ids)
    traj = Trajectory(traj_id="g0/s0", group_id=0, sample_index=0, seed=0, task=task.to_dict(), tools=tools,
                      prompt_len=prompt_len, token_ids=list(full.ids), trainable=list(full.loss_mask),
                      logprobs=[0.0] * len(full.ids), versions=[0] * len(full.ids))
    assert sum(traj.trainable) > 0 and not all(traj.trainable[prompt_len:])  # sampled and env tokens after the prompt

    ids, off = teacher_context(x, traj, messages, effort="high")
    declare = x.render([], tools=tools, effort=OMIT_EFFORT).ids
    effort_msg = x.render([], effort="high").ids
    k = len(declare)
    assert traj.token_ids == ids[:k] + effort_msg + ids[k:]  # the only difference: the effort message
    assert off == -len(effort_msg)
    assert ids == x.render(ep.messages, tools=tools, effort=OMIT_EFFORT).ids  # = the whole episode rendered without effort
    assert all(ids[i + off] == traj.token_ids[i] for i in range(prompt_len, len(traj.token_ids)))
    assert teacher_context(x, traj, messages, effort="high", teacher_effort="high") == (traj.token_ids, 0)
    with pytest.raises(ValueError, match="cannot align"):
        teacher_context(x, traj, messages, effort="low")


def test_teacher_scores_equal_the_students_own_logprobs_when_nothing_differs(xtml_tokenizer, folders):
    """Student = teacher model, student prompted without an effort message: the teacher's context is the
    student's, and its prefill log-probs at the sampled positions equal the engine's behaviour log-probs."""
    tok = xtml_tokenizer
    x = XTML(tok)
    student = _model(tok, 0)
    tasks = get_family("general.arithmetic").generate(2, seed=1) + get_family("agents.search").generate(1, seed=1)
    groups = _rollout(student, tok, tasks, effort_fn=lambda t: None, k=2)
    pool = TeacherPool({"self": folders["student"]})
    trajs = [t for g in groups for t in g.trajectories]
    ctx = [teacher_context(x, t, initial_messages(t.task_obj), effort=None) for t in trajs]
    assert all(ids == t.token_ids and off == 0 for (ids, off), t in zip(ctx, trajs))
    pos = [[i for i, m in enumerate(t.trainable) if m] for t in trajs]
    scores = pool.score("self", [c[0] for c in ctx], pos)
    for t, p, s in zip(trajs, pos, scores):
        assert len(p) > 0
        assert max(abs(a - t.logprobs[i]) for a, i in zip(s, p)) < TOL


# --------------------------------------------------------------------------- the pool


def test_pool_loads_on_demand_and_evicts_the_least_recently_used(xtml_tokenizer, folders):
    """max_resident = 2; uses a, b, a, c, b, c:
        a load [a] · b load [a, b] · a hit [b, a] · c load, evict b [a, c] · b load, evict a [c, b] · c hit [b, c]
    → loads 4, hits 2, evictions 2, resident [b, c] (least recently used first)."""
    pool = TeacherPool({"a": folders["t1"], "b": folders["t2"], "c": folders["student"]}, max_resident=2)
    seen = {}
    for name, resident in zip("abacbc", (["a"], ["a", "b"], ["b", "a"], ["a", "c"], ["c", "b"], ["b", "c"])):
        m = pool.model(name)
        assert pool.resident == resident
        assert not m.training and not any(p.requires_grad for p in m.parameters())
        seen.setdefault(name, []).append(m)
    assert {k: pool.stats[k] for k in ("loads", "hits", "evictions")} == {"loads": 4, "hits": 2, "evictions": 2}
    assert seen["a"][0] is seen["a"][1] and seen["c"][0] is seen["c"][1]  # hits return the resident model
    assert seen["b"][0] is not seen["b"][1]  # b was evicted and loaded again
    with pytest.raises(ValueError, match="no teacher"):
        pool.model("d")
    with pytest.raises(ValueError, match="max_resident"):
        TeacherPool({"a": folders["t1"]}, max_resident=0)
    with pytest.raises(ValueError, match="neither a model folder"):
        TeacherPool({"a": folders["t1"] + "/missing"})


def test_pool_scores_batched_prefill_equal_unpadded_hf_forwards(xtml_tokenizer, folders):
    """Three sequences of different lengths scored in one padded batch and in one-row batches: both equal
    log_softmax of a plain HF forward of each sequence alone at the asked positions."""
    teacher = _model(xtml_tokenizer, 1, initializer_range=0.1)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 390, (n,), generator=g).tolist() for n in (9, 23, 14)]
    positions = [[1, 4, 8], list(range(10, 23)), [13, 2, 7]]  # any order
    want = [[_hf_logprobs(teacher, s)[p] for p in pos] for s, pos in zip(ids, positions)]
    for batch_tokens in (10_000, 1):
        pool = TeacherPool({"t": folders["t1"]}, batch_tokens=batch_tokens)
        got = pool.score("t", ids, positions)
        for w, s in zip(want, got):
            assert s == pytest.approx(w, abs=TOL)
        assert pool.stats["sequences"] == 3 and pool.stats["tokens"] == 3 + 13 + 3
    with pytest.raises(ValueError, match="positions must lie"):
        pool.score("t", [[1, 2, 3]], [[3]])
    with pytest.raises(ValueError, match="positions must lie"):
        pool.score("t", [[1, 2, 3]], [[0]])


class _PromptLogprobServer:
    """A scripted OpenAI-compatible server answering ``/v1/completions`` with ``echo=True, logprobs=0,
    max_tokens=0`` the vLLM way (``token_logprobs`` per prompt token, None first) from a real HF forward."""

    def __init__(self, model) -> None:
        self.model, self.bodies = model, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if self.path != "/v1/completions" or body.get("model") == "broken":
                    self.send_response(400)
                    self.end_headers()
                    self.wfile.write(b'{"error": "bad request"}')
                    return
                choices = []
                for i, ids in enumerate(body["prompt"]):
                    lp = _hf_logprobs(outer.model, ids)
                    choices.append({"index": i, "text": "", "finish_reason": "length",
                                    "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": [None] + lp[1:],
                                                 "top_logprobs": None, "text_offset": list(range(len(ids)))}})
                data = json.dumps({"object": "text_completion", "choices": choices[::-1]}).encode()  # any order
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endpoint_teacher_scores_through_prompt_logprobs(xtml_tokenizer, folders):
    """An endpoint teacher gives the same scores as the same weights loaded locally; the request follows
    the vLLM convention (token-id prompts, echo, logprobs 0, max_tokens 0, the URL's #model)."""
    server = _PromptLogprobServer(_model(xtml_tokenizer, 2, initializer_range=0.1))
    try:
        pool = TeacherPool({"remote": server.url + "/v1#teacher-2", "local": folders["t2"], "broken": server.url + "#broken"})
        ids = [[3, 17, 40, 9, 12, 8], [7, 8, 9, 10]]
        pos = [[1, 2, 5], [3]]
        remote = pool.score("remote", ids, pos)
        for r, loc in zip(remote, pool.score("local", ids, pos)):
            assert r == pytest.approx(loc, abs=TOL)
        assert server.bodies[0] == {"model": "teacher-2", "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0,
                                    "temperature": 0.0}
        assert pool.stats["endpoint_requests"] == 1 and pool.stats["loads"] == 1
        with pytest.raises(RuntimeError, match="HTTP 400"):
            pool.score("broken", ids, pos)
        with pytest.raises(ValueError, match="endpoint"):
            pool.model("remote")
        pool.close()
    finally:
        server.close()


def test_score_all_scores_resident_teachers_first(xtml_tokenizer, folders):
    """Resident [c, b] (c least recent), jobs for a and c: sorted order would load a (evicting c) and then
    reload c; resident-first scores c (a hit), then loads a (evicting b): 1 load instead of 2, same scores."""
    pool = TeacherPool({"a": folders["t1"], "b": folders["t2"], "c": folders["student"]}, max_resident=2)
    for name in ("c", "b"):
        pool.model(name)
    assert pool.resident == ["c", "b"]
    ids, pos = [[3, 17, 40, 9, 12]], [[1, 3, 4]]
    before = dict(pool.stats)
    got = pool.score_all({"a": (ids, pos), "c": (ids, pos)})
    assert pool.stats["loads"] - before["loads"] == 1 and pool.stats["hits"] - before["hits"] == 1
    assert pool.resident == ["c", "a"]
    ref = TeacherPool({"a": folders["t1"], "c": folders["student"]}, max_resident=2)
    assert got == {"a": ref.score("a", ids, pos), "c": ref.score("c", ids, pos)}


# --------------------------------------------------------------------------- the signal


def _signal_cfg(folder: str, **kw) -> MOPDConfig:
    base = dict(experts={"general.high": folder, "agents.high": folder}, effort_mix={"high": 1.0},
                domains=["general", "agents"], rl=RLConfig(seed=0), teacher_sees_effort=False)  # SPEC §4's teacher view
    base.update(kw)
    return MOPDConfig(**base)


@pytest.fixture(scope="module")
def student_groups(xtml_tokenizer):
    """(student, groups): 2 general.arithmetic tasks and 1 agents.search task, K = 3, effort "high"."""
    student = _model(xtml_tokenizer, 0)
    tasks = get_family("general.arithmetic").generate(2, seed=2) + get_family("agents.search").generate(1, seed=2)
    return student, _rollout(student, xtml_tokenizer, tasks, effort_fn=effort_sampler({"high": 1.0}, 0), k=3)


def test_opd_signal_is_zero_when_the_teacher_is_the_student(xtml_tokenizer, folders, student_groups):
    """Teacher = the student's own weights and the teacher sees the same effort message: t_i = s_i at every
    sampled token (prefill vs the engine's decode, within 1e-5), so r_i = 0; env / prompt tokens get 0."""
    _, groups = student_groups
    pool = TeacherPool({"general.high": folders["student"], "agents.high": folders["student"]})
    seqs, m = opd_signal(pool, _signal_cfg(folders["student"], teacher_sees_effort=True), XTML(xtml_tokenizer))(groups)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(seqs) == len(trajs) == 9
    for s, t in zip(seqs, trajs):
        assert (s.token_ids, s.mask, s.behavior_logp) == (t.token_ids, t.trainable, t.logprobs)
        assert max(abs(a) for a in s.advantages) < TOL
        assert all(a == 0.0 for a, mk in zip(s.advantages, s.mask) if not mk)
    assert abs(m["opd_reward"]) < TOL and abs(m["reverse_kl"]) < TOL and m["opd_clip_frac"] == 0.0
    assert m["opd_tokens"] == sum(t.num_sampled for t in trajs)
    assert (m["expert/general.high"], m["expert/agents.high"]) == (6.0, 3.0)


def test_opd_signal_golden_against_an_hf_forward_of_another_teacher(xtml_tokenizer, folders, student_groups):
    """A different teacher (t1) that does not see the effort: by hand, per sampled token i of each trajectory,
        ctx = render(prompt messages, tools, effort=OMIT_EFFORT, think, generation prefix) + tokens[prompt_len:]
        t_i = log_softmax(t1(ctx))[i + off − 1, tokens[i]],   off = len(render) − prompt_len
        r_i = clip(t_i − behaviour_i, −0.3, 0.3)
    and with w_orm = 0.5 and group rewards [1, 0, 0] (general groups): A = r − mean = [2/3, −1/3, −1/3],
    every sampled token's reward moves by 0.5·A; the agents group's rewards [0, 0, 0] give A = 0."""
    _, groups = student_groups
    x = XTML(xtml_tokenizer)
    teacher = _model(xtml_tokenizer, 1, initializer_range=0.1)
    pool = TeacherPool({"general.high": folders["t1"], "agents.high": folders["t1"]})
    seqs, m = opd_signal(pool, _signal_cfg(folders["t1"], r_max=0.3), x)(groups)
    trajs = [t for g in groups for t in g.trajectories]
    gaps, clipped = [], 0
    for s, t in zip(seqs, trajs):
        head = x.render(initial_messages(t.task_obj), tools=t.tools or None, effort=OMIT_EFFORT, add_generation_prompt=True).ids
        ctx = head + t.token_ids[t.prompt_len :]
        off = len(head) - t.prompt_len
        lp = _hf_logprobs(teacher, ctx)
        for i, mk in enumerate(t.trainable):
            if not mk:
                assert s.advantages[i] == 0.0
                continue
            gap = lp[i + off] - t.logprobs[i]
            gaps.append(gap)
            clipped += abs(gap) > 0.3
            assert s.advantages[i] == pytest.approx(max(-0.3, min(0.3, gap)), abs=TOL)
    assert 0 < clipped < len(gaps)  # both branches of the clip are exercised
    assert m["reverse_kl"] == pytest.approx(-statistics.fmean(gaps), abs=TOL)
    assert m["opd_clip_frac"] == pytest.approx(clipped / len(gaps))

    groups_r = copy.deepcopy(list(groups))
    for g, r in zip(groups_r, ([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0])):
        for t, rv in zip(g.trajectories, r):
            t.reward = rv
    seqs_orm, m_orm = opd_signal(pool, _signal_cfg(folders["t1"], r_max=0.3, w_orm=0.5), x)(groups_r)
    outcome = [2 / 3, -1 / 3, -1 / 3] * 2 + [0.0] * 3
    for s0, s1, a in zip(seqs, seqs_orm, outcome):
        for v0, v1, mk in zip(s0.advantages, s1.advantages, s0.mask):
            assert v1 == pytest.approx(v0 + 0.5 * a if mk else 0.0, abs=TOL)
    assert m_orm["reward"] == pytest.approx(2 / 9)


def test_opd_signal_leaves_infra_failures_out(xtml_tokenizer, folders, student_groups):
    """Issue 30 §4.5: a sample whose env worker was lost (``infra``) is not in the loss, and the outcome term's
    group baseline is over the valid samples: the first general group [1, 0, lost] gives A = [1/2, −1/2] (before:
    the lost sample's reward counted as 0, A = [2/3, −1/3, −1/3], and it was trained on)."""
    _, groups = student_groups
    x = XTML(xtml_tokenizer)
    pool = TeacherPool({"general.high": folders["t1"], "agents.high": folders["t1"]})
    groups_r = copy.deepcopy(list(groups))
    for g, r in zip(groups_r, ([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0])):
        for t, rv in zip(g.trajectories, r):
            t.reward = rv
    base, _ = opd_signal(pool, _signal_cfg(folders["t1"], r_max=0.3), x)(groups_r)  # per-token term only
    lost = groups_r[0].trajectories[2]
    lost.infra, lost.reward, lost.finish = "env_lost", None, "infra"
    seqs, m = opd_signal(pool, _signal_cfg(folders["t1"], r_max=0.3, w_orm=0.5), x)(groups_r)
    assert len(seqs) == 8
    outcome = [1 / 2, -1 / 2] + [2 / 3, -1 / 3, -1 / 3] + [0.0] * 3
    for s0, s1, a in zip([s for i, s in enumerate(base) if i != 2], seqs, outcome):
        assert s1.token_ids == s0.token_ids
        for v0, v1, mk in zip(s0.advantages, s1.advantages, s0.mask):
            assert v1 == pytest.approx(v0 + 0.5 * a if mk else 0.0, abs=TOL)
    assert m["reward"] == pytest.approx(2 / 8)


# --------------------------------------------------------------------------- the run


def _run_cfg(folders, **kw) -> MOPDConfig:
    rl = RLConfig().with_settings(dict(steps=4, n_tasks=6, save_every=2, progress=False, optim={"lr": 3e-3},
                                       rollout={"n_prompts": 3, "k": 3, "max_tokens": 24, "lambda_": 0.5}))
    rl = rl.with_settings(kw.pop("rl", {}))
    base = dict(experts={"general.high": folders["t1"], "general.max": folders["t1"]},
                effort_mix={"high": 0.5, "max": 0.5}, domains=["general"], families={"general": ["general.arithmetic"]},
                max_resident=1, rl=rl, teacher_sees_effort=False)
    base.update(kw)
    return MOPDConfig(**base)


def _strip(history):
    return [{k: v for k, v in h.items() if not k.endswith("_s")} for h in history]


def test_train_mopd_resumes_exactly_after_a_kill(xtml_tokenizer, folders, tmp_path):
    """4 steps straight vs 2 steps, a restart from the start weights (new model object, new teacher pool),
    then 2 more: the same per-step metrics and bit-identical weights. λ = 0.5 pauses trajectories, both
    efforts are drawn, and max_resident = 1 with two experts evicts and reloads teachers every step."""
    tok = xtml_tokenizer
    cfg = _run_cfg(folders)
    start = _model(tok, 0)
    a = copy.deepcopy(start)
    ra = train_mopd(a, tok, cfg, tmp_path / "a")
    assert ra.steps == 4 and ra.resumed_from is None
    assert sum(ra.metrics.series("paused")) > 0, "nothing was paused: resume would not be exercised"
    assert ra.metrics.series("expert/general.high")[0] > 0 and sum(ra.metrics.series("expert/general.max")) > 0
    assert ra.teacher_stats["evictions"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), start.parameters()))

    b = copy.deepcopy(start)
    assert train_mopd(b, tok, cfg, tmp_path / "b", stop_after=2).steps == 2
    b2 = copy.deepcopy(start)
    rb = train_mopd(b2, tok, cfg, tmp_path / "b")
    assert rb.resumed_from == 2 and rb.steps == 4
    assert _strip(rb.metrics) == _strip(ra.metrics)
    for (n, p), q in zip(a.named_parameters(), b2.parameters()):
        assert torch.equal(p, q), n


def _probe_reverse_kl(model, tok, pool: TeacherPool, experts: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """(effort, expert) → mean behaviour − teacher log-prob over the student's samples (fixed seeds) on 8
    fixed held-out arithmetic prompts × 4 samples per effort: the k1 estimate of KL(student ‖ teacher)."""
    x = XTML(tok)
    tasks = get_family("general.arithmetic").generate(8, seed=123)
    out = {}
    for effort in ("high", "max"):
        groups = _rollout(model, tok, tasks, effort_fn=lambda t, e=effort: e, k=4, max_tokens=24)
        trajs = [t for g in groups for t in g.trajectories]
        ctx = [teacher_context(x, t, initial_messages(t.task_obj), effort=effort) for t in trajs]
        pos = [[i + off for i, mk in enumerate(t.trainable) if mk] for t, (_, off) in zip(trajs, ctx)]
        for expert in experts:
            scores = pool.score(expert, [c[0] for c in ctx], pos)
            out[effort, expert] = statistics.fmean(
                s - tl for t, lp in zip(trajs, scores) for s, tl in zip((v for v, mk in zip(t.logprobs, t.trainable) if mk), lp))
    return out


def test_train_mopd_in_exact_mode(xtml_tokenizer, folders, tmp_path):
    """mopd.rl.rollout.exact: the student's engine and its trainer run the exact forward, so every token the trained weights
    sampled has a gap of exactly 0 (a step raises otherwise), with λ = 0.5 pausing and re-prefilling trajectories."""
    from k3post.loop import rollout_gap
    from k3post.quant.qat import QATConfig, apply_qat

    student = _model(xtml_tokenizer, 0)
    apply_qat(student, QATConfig())
    cfg = _run_cfg(folders, rl=dict(steps=2, rollout={"exact": True, "resume_kv": "reprefill"}))
    res = train_mopd(student, xtml_tokenizer, cfg, tmp_path / "x")
    g = rollout_gap(res.metrics.rows())
    assert res.steps == 2 and g["tokens"] > 0 and g["max"] == 0.0, g


@pytest.mark.slow
def test_train_mopd_moves_the_student_toward_its_teacher(xtml_tokenizer, folders, tmp_path):
    """6 MOPD steps against teacher t1 (both efforts) cut the student's reverse KL to t1 on held-out prompts
    by more than 20 % at each effort (fresh samples, fixed seeds; measured: 0.34 → 0.23, 0.32 → 0.23), while
    its reverse KL to an unrelated model of the same kind (t2) does not fall alike (measured: 0.35 → 0.47):
    the student learnt t1, not merely "something sharper"."""
    tok = xtml_tokenizer
    student = _model(tok, 0)
    pool = TeacherPool({"t1": folders["t1"], "t2": folders["t2"]}, max_resident=2)
    before = _probe_reverse_kl(student, tok, pool, ("t1", "t2"))
    cfg = _run_cfg(folders, max_resident=2, rl=dict(steps=6, n_tasks=16, save_every=100, optim={"lr": 5e-3},
                                                    rollout={"n_prompts": 4, "k": 4}))
    res = train_mopd(student, tok, cfg, tmp_path / "run")
    after = _probe_reverse_kl(student, tok, pool, ("t1", "t2"))
    for e in ("high", "max"):
        assert after[e, "t1"] < 0.8 * before[e, "t1"], (before, after)
        assert before[e, "t1"] - after[e, "t1"] > 2 * (before[e, "t2"] - after[e, "t2"]), (before, after)
    assert res.steps == 6 and res.teacher_stats["loads"] == 2 and res.teacher_stats["evictions"] == 0


def test_train_mopd_needs_a_teacher_for_every_domain_and_effort(xtml_tokenizer, folders, tmp_path):
    cfg = _run_cfg(folders, effort_mix={"high": 1.0, "low": 1.0})
    with pytest.raises(ValueError, match=r"lacks a teacher for \['general.low'\]"):
        train_mopd(_model(xtml_tokenizer, 0), xtml_tokenizer, cfg, tmp_path)
    with pytest.raises(ValueError, match="not in mopd.domains"):  # checked when the config loads (issue 30 §5)
        _run_cfg(folders, families={"coding": ["coding.bugfix"]})


# --------------------------------------------------------------------------- evaluation


def test_mopd_checks_golden():
    """By hand (pass ratio ≥ 0.95, tokens within ±20 %, student T(y) ordered low < high < max per domain):
      general low : pass 0.50 vs 0.52 → 0.50 ≥ 0.494 ok;  T 10 vs 12 → |−2| ≤ 2.4 ok
      general high: pass 0.60 vs 0.70 → 0.60 < 0.665 no;  T 20 vs 16 → 4 > 3.2 no
      general max : teacher passes 0.00 < 0.2 → not applicable (None, ratio nan);  T 30 vs 25 → 5 ≤ 5 ok
      general order 10 < 20 < 30 ok;  agents (low 40, high 35) order no; agents rows ok."""
    rows = [dict(domain="general", effort=e, student_pass=sp, teacher_pass=tp, student_tokens=st, teacher_tokens=tt)
            for e, sp, tp, st, tt in (("low", 0.5, 0.52, 10, 12), ("high", 0.6, 0.7, 20, 16), ("max", 0.0, 0.0, 30, 25))]
    rows += [dict(domain="agents", effort=e, student_pass=1.0, teacher_pass=1.0, student_tokens=t, teacher_tokens=t)
             for e, t in (("high", 35), ("low", 40))]
    out = mopd_checks(rows)
    got = [(r["pass_ok"], r["tokens_ok"]) for r in out["rows"]]
    assert got == [(True, True), (False, False), (None, True), (True, True), (True, True)]
    assert out["rows"][0]["pass_ratio"] == pytest.approx(0.5 / 0.52) and out["rows"][1]["token_ratio"] == 1.25
    assert math.isnan(out["rows"][2]["pass_ratio"])
    assert out["order"]["general"] == {"tokens": {"low": 10.0, "high": 20.0, "max": 30.0}, "ok": True}
    assert out["order"]["agents"]["ok"] is False and out["ok"] is False
    ok_rows = [r for r in rows if r["domain"] == "general" and r["effort"] != "high"]
    assert mopd_checks(ok_rows)["ok"] is True
    # a teacher at 0.15 is below teacher_pass_min = 0.2: no pass check however bad the student; at 0.25 it counts
    weak = dict(domain="coding", effort="max", student_pass=0.0, teacher_pass=0.15, student_tokens=9, teacher_tokens=9)
    assert mopd_checks([weak])["rows"][0]["pass_ok"] is None and mopd_checks([weak])["ok"] is True
    assert mopd_checks([{**weak, "teacher_pass": 0.25}])["ok"] is False
    # the threshold travels with the table, and the report labels a not-applicable row with it
    table = mopd_checks([weak], teacher_pass_min=0.1)
    assert table["teacher_pass_min"] == 0.1 and table["rows"][0]["pass_ok"] is False
    from k3post.recipes.report import _mopd_section

    html = _mopd_section(Path("/nonexistent"), {"mopd": {"table": mopd_checks([weak], teacher_pass_min=0.3), "steps": 1,
                                                         "seconds": 1.0}})
    assert "n/a (teacher &lt; 0.3)" in html


def test_paired_ratio_golden():
    """a = both pass, b = only before, c = only after. a=40, b=10, c=5, n=100: R = 45 / 50 = 0.9,
    Var(ln R) = (10 + 5) / (50 · 45) = 1/150, half = 1.96 · 0.08165 = 0.16003 → [0.9 e^-0.16003, 0.9 e^0.16003]
    = [0.7669, 1.0562]. Zero cells get ½ (finite interval); before = 0 → ratio nan."""
    from k3post.stats import paired_change, paired_ratio

    before = [True] * 40 + [True] * 10 + [False] * 5 + [False] * 45
    after = [True] * 40 + [False] * 10 + [True] * 5 + [False] * 45
    r = paired_ratio(paired_change(before, after))
    assert r["ratio"] == pytest.approx(0.9)
    assert r["ci95"] == pytest.approx([0.76688, 1.05622], abs=1e-4)
    same = paired_ratio(paired_change(before, before))  # b = c = 0: ratio 1, a narrow finite interval around it
    assert same["ratio"] == 1.0 and same["ci95"][0] < 1.0 < same["ci95"][1] and math.isfinite(same["ci95"][1])
    none = paired_ratio(paired_change([False] * 5, [True] * 5))
    assert math.isnan(none["ratio"]) and none["ci95"] == [0.0, math.inf]


def test_evaluate_mopd_student_equal_to_its_teacher_meets_every_row_target(xtml_tokenizer, folders):
    """The student engine runs the same weights as the teacher folder and the teacher sees the same effort:
    every row has identical student and teacher numbers, so pass and token checks hold (ratios 1 or nan)."""
    tok = xtml_tokenizer
    x = XTML(tok)
    pool = TeacherPool({"general.low": folders["t1"], "general.max": folders["t1"]})
    student = EmbeddedEngine(_model(tok, 1, initializer_range=0.1), tok)
    tasks = {"general": get_family("general.arithmetic").generate(3, seed=9)}
    out = evaluate_mopd(student, x, pool, tasks, efforts=("low", "max"), max_tokens=12, teacher_sees_effort=True)
    assert [(r["domain"], r["effort"], r["n"]) for r in out["rows"]] == [("general", "low", 3), ("general", "max", 3)]
    for r in out["rows"]:
        assert (r["student_pass"], r["student_tokens"]) == (r["teacher_pass"], r["teacher_tokens"])
        assert r["pass_ok"] is not False and r["tokens_ok"] and r["student_tokens"] > 0
        if r["teacher_pass"] > 0:
            assert r["pass_ratio"] == 1.0 and r["pass_ratio_ci95"][0] <= 1.0 <= r["pass_ratio_ci95"][1]
    assert set(out["order"]["general"]["tokens"]) == {"low", "max"}


def test_evaluate_mopd_with_an_endpoint_teacher_reports_the_student_alone(xtml_tokenizer, folders):
    """An endpoint teacher (mopd.experts.X=http://...) scores log-probs in training but is not sampled here:
    evaluation raised "is an endpoint, not a local model" after training had finished (the README's command;
    found by tests/test_docs.py). Its row now has the student's numbers, NaN teacher numbers, checks not
    applicable (None) and does not fail the table; the local teacher's row is as before. The report says why."""
    from k3post.recipes.report import _mopd_section

    tok = xtml_tokenizer
    x = XTML(tok)
    pool = TeacherPool({"general.low": folders["t1"], "general.max": "http://127.0.0.1:9/v1"})  # never called
    student = EmbeddedEngine(_model(tok, 1, initializer_range=0.1), tok)
    tasks = {"general": get_family("general.arithmetic").generate(3, seed=9)}
    out = evaluate_mopd(student, x, pool, tasks, efforts=("low", "max"), max_tokens=12, teacher_sees_effort=True)
    low, high = out["rows"]
    assert low["tokens_ok"] is True and "teacher_endpoint" not in low
    assert high["teacher_endpoint"] == "http://127.0.0.1:9/v1" and high["n"] == 3 and high["student_tokens"] > 0
    assert math.isnan(high["teacher_pass"]) and high["pass_ok"] is None and high["tokens_ok"] is None
    assert pool.stats["endpoint_requests"] == 0 and out["ok"] == out["order"]["general"]["ok"]  # only the order can fail
    html = _mopd_section(Path("/nonexistent"), {"mopd": {"table": out, "steps": 1, "seconds": 1.0}})
    assert "n/a (endpoint teacher: not sampled)" in html


def test_evaluate_mopd_with_the_teachers_in_a_second_process_gives_the_same_table(xtml_tokenizer, folders):
    """processes=2: the local teachers' episodes run in a spawned worker beside the student's. Two different
    teachers and an endpoint row: the table equals the one-process table exactly (same episodes, greedy), and the
    worker's teacher loads count in the pool's stats."""
    tok = xtml_tokenizer
    x = XTML(tok)
    experts = {"general.low": folders["t1"], "general.high": "http://127.0.0.1:9/v1", "general.max": folders["t2"]}
    student = EmbeddedEngine(_model(tok, 1, initializer_range=0.1), tok)
    tasks = {"general": get_family("general.arithmetic").generate(3, seed=9)}
    kw = dict(efforts=("low", "high", "max"), max_tokens=12)
    one = evaluate_mopd(student, x, TeacherPool(experts), tasks, **kw)
    pool = TeacherPool(experts)
    two = evaluate_mopd(student, x, pool, tasks, processes=2, **kw)
    assert json.dumps(two, sort_keys=True, default=str) == json.dumps(one, sort_keys=True, default=str)
    assert [r["expert"] for r in two["rows"]] == ["general.low", "general.high", "general.max"]
    assert pool.stats["loads"] == 2 and not pool.resident  # loaded in the worker, not here


@pytest.mark.parametrize("override, message", [
    ("mopd.effort_mix.medium=1", "mopd.effort_mix: unknown efforts"),
    ("mopd.domains=[web]", r"unknown domain\(s\) \['web'\]"),
    ("mopd.r_max=-1", "mopd.r_max > 0"),
])
def test_bad_mopd_config_fails_at_load(override, message):
    from k3post.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_evaluate_mopd_takes_a_known_teacher_evaluation_instead_of_running_it_again(xtml_tokenizer, folders):
    """``known``: a teacher's own greedy episodes on the same tasks (the expert's held-out evaluation) stand for
    it: the table equals the measured one but for ``teacher_source``, and that teacher is never loaded. A known
    evaluation of other tasks is refused (it cannot be paired with the student's episodes)."""
    from k3post.stages.mopd import _episodes

    tok = xtml_tokenizer
    x = XTML(tok)
    experts = {"general.low": folders["t1"], "general.max": folders["t2"]}
    student = EmbeddedEngine(_model(tok, 1, initializer_range=0.1), tok)
    tasks = {"general": get_family("general.arithmetic").generate(3, seed=9)}
    kw = dict(efforts=("low", "max"), max_tokens=12, teacher_sees_effort=True)
    measured = evaluate_mopd(student, x, TeacherPool(experts), tasks, **kw)
    pool = TeacherPool(experts)
    own = _episodes(EmbeddedEngine(pool.model("general.max"), tok), x, tasks["general"], "max", 12)
    pool = TeacherPool(experts)
    reused = evaluate_mopd(student, x, pool, tasks, known={"general.max": own}, **kw)
    assert pool.stats["loads"] == 1  # general.low only
    src = [r.pop("teacher_source") for r in reused["rows"]]
    assert src == ["measured here", "expert evaluation"]
    for r in measured["rows"]:
        r.pop("teacher_source")
    assert json.dumps(reused, sort_keys=True, default=str) == json.dumps(measured, sort_keys=True, default=str)
    other = _episodes(EmbeddedEngine(pool.model("general.max"), tok), x,
                      get_family("general.arithmetic").generate(3, seed=10), "max", 12)
    with pytest.raises(ValueError, match="known teacher evaluation of general.max ran other tasks"):
        evaluate_mopd(student, x, pool, tasks, known={"general.max": other}, **kw)


def test_reusable_teacher_evals_takes_only_the_runs_own_experts_measured_as_mopd_would(tmp_path):
    """`reusable_teacher_evals`: an expert's held-out summary is reused only where it is the run's own expert
    folder, evaluated at MOPD's per-turn cap on the same tasks in the same order, with the effort message and fp32
    teachers; each difference leaves that expert to be measured."""
    from dataclasses import replace

    from k3post.config import load_config
    from k3post.recipes.commands import mopd_config_for_run, reusable_teacher_evals
    from k3post.stages.mopd import eval_caps, mopd_eval_tasks

    cfg = load_config(None, ["mopd.domains=[general]", "rl.domain_overrides.general.eval_n=4"])
    experts_dir = tmp_path / "experts"
    for e in ("max", "high", "low"):
        (experts_dir / f"general.{e}").mkdir(parents=True)
        (experts_dir / f"general.{e}" / "config.json").write_text("{}")
    m = mopd_config_for_run(cfg, experts_dir)
    tasks, caps = mopd_eval_tasks(m), eval_caps(m)
    ids = [t.id for t in tasks["general"]]
    summary = {"task_ids": ids, "passed": [True, False, True, False], "pass_rate": 0.5}
    table = {"experts": {"general.max": {"eval": {"overall": summary}},
                         "general.high": {"eval": {"overall": {**summary, "task_ids": ids[::-1]}}},  # another order
                         "general.low": {"eval": {"overall": summary}}}}
    (experts_dir / "table.json").write_text(json.dumps(table))
    efforts = ["max", "high", "low"]
    assert set(reusable_teacher_evals(cfg, m, experts_dir, tasks, caps, efforts)) == {"general.max", "general.low"}
    foreign = replace(m, experts={**m.experts, "general.low": str(tmp_path / "elsewhere")})
    assert set(reusable_teacher_evals(cfg, foreign, experts_dir, tasks, caps, efforts)) == {"general.max"}
    assert reusable_teacher_evals(cfg, m, experts_dir, tasks, {"general": caps["general"] + 1}, efforts) == {}
    assert reusable_teacher_evals(cfg, replace(m, teacher_sees_effort=False), experts_dir, tasks, caps, efforts) == {}
    assert reusable_teacher_evals(cfg, replace(m, teacher_dtype="bfloat16"), experts_dir, tasks, caps, efforts) == {}
    assert reusable_teacher_evals(cfg, m, tmp_path / "none", tasks, caps, efforts) == {}


def test_domain_weights_give_a_domain_that_many_prompts_a_round(monkeypatch, xtml_tokenizer, folders, tmp_path):
    """``mopd.domain_weights``: each family of a weighted domain gives its weight in prompts every round of the
    stream (general 2 : coding 1 → g g c g g c ...), with n_tasks × weight of them in all; without weights the
    families take turns as before. `train_mopd` hands the stream its weights."""
    from k3post.envs.families.streams import train_tasks
    import k3post.stages.mopd as mopd_mod

    plain = train_tasks(["general.arithmetic", "coding.write_function"], 3, difficulty=1)
    assert [t.family[0] for t in plain] == list("gcgcgc")
    weighted = train_tasks(["general.arithmetic", "coding.write_function"], 3, difficulty=1, weights=[2, 1])
    assert [t.family[0] for t in weighted] == list("ggcggcggc")
    alone = train_tasks(["general.arithmetic"], 6, difficulty=1)  # the weighted family's own stream, in order
    assert [t.id for t in weighted if t.family == "general.arithmetic"] == [t.id for t in alone]
    with pytest.raises(ValueError, match="one weight >= 1 per family"):
        train_tasks(["general.arithmetic"], 3, difficulty=1, weights=[0])
    seen = {}
    real = mopd_mod.train_tasks

    def spy(fams, n, **kw):  # noqa: ANN001, ANN202
        seen.update(fams=list(fams), weights=kw.get("weights"))
        return real(fams, n, **kw)

    monkeypatch.setattr(mopd_mod, "train_tasks", spy)
    cfg = _run_cfg(folders, domain_weights={"general": 3}, rl={"steps": 1})
    train_mopd(_model(xtml_tokenizer, 0), xtml_tokenizer, cfg, tmp_path / "w")
    assert seen == {"fams": ["general.arithmetic"], "weights": [3]}


@pytest.mark.parametrize("override, message", [
    ("mopd.domain_weights.general=0", "mopd.domain_weights must be whole numbers >= 1"),
    ("mopd.domain_weights.web=2", r"unknown domain\(s\) \['web'\]"),
])
def test_bad_domain_weights_fail_at_load(override, message):
    from k3post.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, [override])
