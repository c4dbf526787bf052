"""SFT data synthesis: teachers (reference, endpoint with retries, local model), the verification
stages and their funnel, crash-safe output, mixing and the `k3post synth` / `k3post mix` commands."""

from __future__ import annotations

import argparse
import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3post.data import load_sft_jsonl
from k3post.envs.families.general import family as general
from k3post.envs.task import Task
from k3post.rollout.engine import SamplingParams
from k3post.synth import (
    EndpointTeacher,
    Funnel,
    JudgeResult,
    LocalModelTeacher,
    ReferenceTeacher,
    StageResult,
    VerifyConfig,
    VerifyContext,
    build_sft_dataset,
    count_sample_tokens,
    find_family,
    judge_stage,
    mix,
    outcome_stage,
    quality_stage,
    read_jsonl,
    structure_stage,
    synthesize,
    verify_samples,
)
from k3post.synth.cli import add_mix_parser, add_synth_parser
from k3post.synth.mix import allocate, group_weight, load_mix_config, mix_files
from k3post.synth.verify import Deduper, repetition_loop, structure_tokenizer
from k3post.xtml import OMIT_EFFORT, XTML

ARITH = general.ARITHMETIC
WRITING = general.WRITING


def _ctx(**kw: Any) -> VerifyContext:
    return VerifyContext(VerifyConfig(**kw))


@pytest.fixture(scope="module")
def arith_samples() -> list[dict[str, Any]]:
    return synthesize(ARITH, effort="max", n=4, seed=0)


@pytest.fixture(scope="module")
def search_sample() -> dict[str, Any]:
    return synthesize("agents.search", effort="high", n=1, seed=0)[0]


# --------------------------------------------------------------------------- synthesis + the whole pipeline


def test_reference_pipeline_over_every_builtin_family(tmp_path: Path) -> None:
    """Every built-in family × 3 efforts: all reference trajectories pass all stages, the SFT file
    loads with the SFT loader, and every record carries its provenance."""
    out = tmp_path / "sft.jsonl"
    path, funnel = build_sft_dataset(None, ["low", "high", "max"], 2, 0, out)
    recs = read_jsonl(path)
    fams = {r["family"] for r in recs}
    assert {"general.arithmetic", "general.faithfulness", "general.writing"} <= fams
    assert funnel.total == len(recs) == 2 * 3 * len(fams)
    assert funnel.final["keep"] == funnel.total, funnel.table()
    for stage in funnel.stages.values():  # each stage saw every sample and kept it
        assert (stage.seen, stage.kept, stage.rejected, stage.uncertain) == (funnel.total, funnel.total, 0, 0)
    for r in recs:
        assert r["teacher"] == "reference" and r["seed"] == 0 and r["effort"] in ("low", "high", "max")
        assert r["reward"] == 1.0 and r["domain"] == r["family"].split(".")[0]
        assert set(r["tokens"]) == {"reasoning", "output", "total", "method"} and r["tokens"]["total"] >= r["tokens"]["output"] > 0
    samples, stats = load_sft_jsonl(path, XTML(structure_tokenizer()), max_len=100_000)
    assert stats.kept == len(recs) and not stats.skipped
    assert len(read_jsonl(out.with_name("sft.raw.jsonl"))) == len(recs)
    summary = json.loads(out.with_name("sft.funnel.json").read_text())
    assert summary["kept"] == summary["written"] == len(recs) and [s["name"] for s in summary["stages"]] == ["structure", "outcome", "quality", "judge"]


def test_token_counts_exact_with_tokenizer_and_words_without(arith_samples: list[dict[str, Any]]) -> None:
    tok = structure_tokenizer()
    x = XTML(tok)
    s = arith_samples[0]
    exact = count_sample_tokens(s["messages"], s["tools"], "max", x)
    r = x.render(s["messages"], effort="max")
    reasoning = s["messages"][-1]["reasoning_content"]
    # no merges: one token per byte of the think channel
    assert exact == {"reasoning": len(reasoning.encode()), "output": sum(r.loss_mask), "total": len(r.ids), "method": "xtml"}
    msgs = [
        {"role": "user", "content": "add two and three"},  # 4 words
        {"role": "assistant", "reasoning_content": "2 + 3 = 5", "content": "5"},  # 5 + 1 words
    ]
    assert count_sample_tokens(msgs, None, "low") == {"reasoning": 5, "output": 6, "total": 10, "method": "words"}
    msgs[1]["num_tokens"] = 9  # a teacher-reported count wins for output
    assert count_sample_tokens(msgs, None, "low")["output"] == 9


def test_dealt_efforts_solve_each_task_once(tmp_path: Path) -> None:
    """deal=True: task i of the family is solved at efforts[i % k] only, so n tasks give n samples (not n * k), each a
    distinct task, the efforts in turn."""
    fam = find_family("coding.write_function")
    path, funnel = build_sft_dataset([fam], ["max", "high", "low"], 6, 3, tmp_path / "d.jsonl", deal=True)
    recs = read_jsonl(path)
    ids = [t.id for t in fam.generate(6, seed=3)]
    assert funnel.total == len(recs) == 6
    assert sorted((ids.index(r["task_id"]), r["effort"]) for r in recs) == [
        (0, "max"), (1, "high"), (2, "low"), (3, "max"), (4, "high"), (5, "low")]
    every, _ = build_sft_dataset([fam], ["max", "high", "low"], 2, 3, tmp_path / "e.jsonl")
    assert len(read_jsonl(every)) == 6 and len({r["task_id"] for r in read_jsonl(every)}) == 2


def test_raw_file_is_appended_and_a_crashed_run_resumes(tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    first = synthesize(ARITH, effort="low", n=3, seed=1, out=raw)
    lines = raw.read_text().splitlines()
    assert len(lines) == 3
    # simulate a crash mid-write of the third sample: a torn last line without newline
    raw.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    calls: list[str] = []

    class Counting(ReferenceTeacher):
        def policy(self, task: Any, effort: str) -> Any:
            calls.append(task.id)
            return super().policy(task, effort)

    again = synthesize(ARITH, Counting(ARITH), effort="low", n=3, seed=1, out=raw)
    assert calls == [json.loads(lines[2])["task_id"]]  # only the lost sample is redone (lines are in finishing order)
    assert [s["id"] for s in again] == [s["id"] for s in first]
    assert len(read_jsonl(raw)) == 3
    with pytest.raises(ValueError, match=r"raw\.jsonl:2: malformed JSON"):
        raw.write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
        read_jsonl(raw)


# --------------------------------------------------------------------------- stage 1: structure


def _call(sample: dict[str, Any], name: str = "search") -> dict[str, Any]:
    for m in sample["messages"]:
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] == name:
                return c
    raise AssertionError(f"no {name} call")


def _last_assistant(sample: dict[str, Any]) -> dict[str, Any]:
    return [m for m in sample["messages"] if m["role"] == "assistant"][-1]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda s: _call(s)["function"].update(arguments=json.dumps({"query": 5})), "arguments_schema"),
        (lambda s: _call(s)["function"].update(arguments=json.dumps({"query": "x", "extra": 1})), "arguments_schema"),
        (lambda s: _call(s)["function"].update(arguments="{not json"), "bad_arguments"),
        (lambda s: _call(s)["function"].update(arguments="[1, 2]"), "bad_arguments"),
        (lambda s: _call(s)["function"].update(name="delete_everything"), "undeclared_tool"),
        (lambda s: _last_assistant(s).update(xtml_error="token 3: unexpected <|sep|>"), "unparseable_completion"),
        (lambda s: s.update(error="RuntimeError: HTTP 503"), "teacher_error"),
        (lambda s: s.update(messages=[m for m in s["messages"] if m["role"] != "assistant"]), "no_assistant_turn"),
        (lambda s: s["messages"].append({"role": "robot", "content": "x"}), "invalid_record"),
        (lambda s: s.update(effort="medium"), "invalid_record"),
    ],
)
def test_structure_stage_rejects(search_sample: dict[str, Any], mutate: Any, reason: str) -> None:
    ctx = _ctx()
    assert structure_stage(search_sample, ctx) == StageResult("keep")
    bad = copy.deepcopy(search_sample)
    mutate(bad)
    res = structure_stage(bad, ctx)
    assert (res.status, res.reason) == ("reject", reason), res


def test_structure_stage_xtml_roundtrip(arith_samples: list[dict[str, Any]]) -> None:
    ctx = _ctx()
    s = copy.deepcopy(arith_samples[0])
    # text spelling a special token is encoded as plain bytes: still valid and round-trips
    s["messages"][-1]["reasoning_content"] += " <|close|>think<|sep|>"
    assert structure_stage(s, ctx).status == "keep"
    s["messages"][-1]["content"] = {"not": "text"}
    res = structure_stage(s, ctx)
    assert (res.status, res.reason) == ("reject", "unrenderable")


# --------------------------------------------------------------------------- stage 2: outcome


def test_outcome_stage_uses_the_verifier(arith_samples: list[dict[str, Any]]) -> None:
    ctx = _ctx()
    s = copy.deepcopy(arith_samples[0])
    assert outcome_stage(s, ctx).status == "keep"
    s["verdict"] = {"reward": 0.5, "components": {}, "diagnostics": "half"}
    assert (outcome_stage(s, ctx).status, outcome_stage(s, ctx).reason) == ("uncertain", "partial_reward")
    assert outcome_stage(s, _ctx(partial_reward="reject")).reason == "verifier_failed"
    s["verdict"]["reward"] = 0.0
    assert outcome_stage(s, ctx).reason == "verifier_failed"
    s["truncated"], s["truncation"] = True, "max_turns"
    assert outcome_stage(s, ctx).reason == "truncated"


def test_outcome_stage_replays_when_no_verdict(arith_samples: list[dict[str, Any]], search_sample: dict[str, Any]) -> None:
    ctx = _ctx()
    s = copy.deepcopy(arith_samples[1])
    s["verdict"] = None
    assert outcome_stage(s, ctx).status == "keep"  # the replayed answer is right
    s["messages"][-1]["content"] = str(int(s["messages"][-1]["content"]) + 1)
    res = outcome_stage(s, ctx)
    assert (res.status, res.reason) == ("reject", "verifier_failed")
    # a forged tool result is caught: the environment returns something else
    forged = copy.deepcopy(search_sample)
    forged["verdict"] = None
    next(m for m in forged["messages"] if m["role"] == "tool")["content"] = "d99 | forged"
    res = outcome_stage(forged, ctx)
    assert (res.status, res.reason) == ("reject", "transcript_mismatch")
    unknown = dict(s, family="general.nope", verdict=None)
    assert outcome_stage(unknown, ctx).reason == "no_verdict"


def test_wrong_policies_are_rejected_at_outcome() -> None:
    task = ARITH.generate(1, seed=3)[0]

    class Wrong:
        name, concurrency = "wrong", 1

        def __init__(self, which: str) -> None:
            self.which = which

        def policy(self, t: Any, effort: str) -> Any:
            return ARITH.wrong_policies(t)[self.which]

    samples = [synthesize(ARITH, Wrong(w), effort="high", n=1, tasks=[task])[0] for w in ("off_by_one", "claims_success", "copied_prompt")]
    rep = verify_samples(samples, _ctx())
    assert not rep.kept and len(rep.rejected) == 3
    assert {f["reason"] for _, f in rep.rejected} == {"verifier_failed"}
    assert rep.funnel.stages["outcome"].reasons["reject"]["verifier_failed"] == 3


# --------------------------------------------------------------------------- stage 3: quality


def test_repetition_loop_detector() -> None:
    assert repetition_loop("a b " * 20, n=8, max_count=3) == "a b a b a b a b"
    text = "one two three four five six seven eight " * 4  # each 8-gram at most 4 times... exactly 4 for the first
    assert repetition_loop(text, n=8, max_count=3) == "one two three four five six seven eight"
    assert repetition_loop(text, n=8, max_count=4) is None
    assert repetition_loop("a short text", n=8, max_count=3) is None


def test_quality_budget_repetition_and_dedup(arith_samples: list[dict[str, Any]]) -> None:
    ctx = _ctx(budgets={"max": 4, "general/low": 100})
    s = copy.deepcopy(arith_samples[0])
    res = quality_stage(s, ctx)
    assert (res.reason, s["tokens"]["reasoning"] > 4) == ("over_budget", True)
    ctx = _ctx()
    assert quality_stage(s, ctx).status == "keep"
    assert quality_stage(copy.deepcopy(s), ctx).reason == "exact_duplicate"
    loop = copy.deepcopy(arith_samples[1])
    loop["messages"][-1]["reasoning_content"] = "wait, let me recompute that again. " * 10
    assert quality_stage(loop, ctx).reason == "repetition_loop"
    # the same trajectory at another effort is not a duplicate (efforts are separate buckets)
    assert quality_stage(dict(copy.deepcopy(s), effort="high"), ctx).status == "keep"


def test_quality_rejects_samples_longer_than_the_trainer_accepts(arith_samples: list[dict[str, Any]]) -> None:
    s = copy.deepcopy(arith_samples[2])
    total = s["tokens"]["total"]
    res = quality_stage(s, _ctx(max_total_tokens=total - 1))
    assert res.reason == "too_long" and f"{total} tokens > max_total_tokens {total - 1}" in res.detail
    assert quality_stage(copy.deepcopy(s), _ctx(max_total_tokens=total)).status == "keep"  # the cap is inclusive


def test_near_duplicate_jaccard() -> None:
    d = Deduper(shingle_words=3, threshold=0.9, postings_cap=64)
    words = [f"w{i}" for i in range(40)]

    def sample(ws: list[str], sid: str) -> dict[str, Any]:
        return {"id": sid, "effort": "max", "messages": [{"role": "assistant", "content": " ".join(ws)}]}

    assert d.check(sample(words, "a")).status == "keep"
    # one word changed in the middle: 38 shingles, 3 differ on each side → |∩| = 35, |∪| = 41, J = 0.854 < 0.9
    changed = words[:20] + ["zz"] + words[21:]
    assert d.check(sample(changed, "b"), add=False).status == "keep"
    # one word appended: 39 vs 38 shingles, 38 shared → J = 38 / 39 = 0.974 ≥ 0.9
    res = d.check(sample(words + ["w40"], "c"))
    assert (res.reason, res.detail) == ("near_duplicate", "Jaccard 0.97 with a")
    # a shingle held by more than postings_cap kept samples is boilerplate and finds no candidates
    d2 = Deduper(shingle_words=1, threshold=0.5, postings_cap=1)
    assert d2.check(sample(["t", "x1"], "a")).status == "keep"
    assert d2.check(sample(["t", "x2"], "b")).status == "keep"  # J = 1/3 < 0.5
    assert d2.check(sample(["t", "x1", "y"], "c")).reason == "near_duplicate"  # via "x1": J = 2/3


# --------------------------------------------------------------------------- stage 4: judge


def test_judge_stage() -> None:
    s = synthesize(WRITING, effort="high", n=1, seed=0)[0]
    ctx = _ctx()
    assert judge_stage(s, ctx).status == "keep"  # reference blurb passes the rule judge
    filler = copy.deepcopy(s)
    filler["messages"][-1]["content"] = filler["messages"][-1]["content"].rstrip(".!") + ", a great choice for everyone."
    res = judge_stage(filler, ctx)
    assert (res.status, res.reason) == ("uncertain", "judge_uncertain") and "no_filler" in res.detail
    one = copy.deepcopy(s)
    one["messages"][-1]["content"] = "Buy it."
    assert judge_stage(one, ctx).reason == "judge_low_score"
    assert judge_stage(s, VerifyContext(judges={})).reason == "no_judge"

    class GRM:  # a pluggable judge: what the GRM will implement
        def judge(self, sample: Any) -> JudgeResult:
            return JudgeResult(0.2, False, "dull")

    assert judge_stage(s, VerifyContext(judges={"*": GRM()})).reason == "judge_low_score"
    arith = synthesize(ARITH, effort="low", n=1)[0]
    assert judge_stage(arith, VerifyContext(judges={"*": GRM()})).reason == "verifiable"


def test_funnel_counts_and_table(arith_samples: list[dict[str, Any]]) -> None:
    ok = [copy.deepcopy(s) for s in arith_samples[:3]]
    bad = copy.deepcopy(arith_samples[3])
    bad["verdict"]["reward"] = 0.0
    dup = copy.deepcopy(arith_samples[0])
    half = copy.deepcopy(arith_samples[3])
    half["id"] = "half"
    half["verdict"]["reward"] = 0.5
    half["messages"][-1]["reasoning_content"] = "different reasoning entirely for this one"
    rep = verify_samples(ok + [bad, dup, half], _ctx())
    f = rep.funnel
    assert (f.total, f.final["keep"], f.final["reject"], f.final["uncertain"]) == (6, 3, 2, 1)
    assert (f.stages["outcome"].seen, f.stages["outcome"].rejected, f.stages["outcome"].uncertain) == (6, 1, 1)
    assert (f.stages["quality"].seen, f.stages["quality"].rejected) == (5, 1)
    assert f.stages["judge"].seen == 4
    table = f.table()
    assert re.search(r"outcome\s+6\s+4\s+1\s+1\s+verifier_failed×1, \?partial_reward×1", table), table
    assert re.search(r"final\s+6\s+3\s+2\s+1", table)
    assert Funnel.from_dict(f.to_dict()).to_dict() == f.to_dict()
    assert rep.uncertain[0][1][0]["reason"] == "partial_reward"


# --------------------------------------------------------------------------- endpoint teacher


class _Scripted(BaseHTTPRequestHandler):
    """A local OpenAI-compatible server that fails its first requests, then solves arithmetic."""

    failures: list[str] = []
    lock = threading.Lock()
    count = 0
    inflight = 0
    max_inflight = 0
    bodies: list[dict[str, Any]] = []

    def log_message(self, *a: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with cls.lock:
            k = cls.count
            cls.count += 1
            mode = cls.failures[k] if k < len(cls.failures) else "ok"
            cls.bodies.append(body)
        if mode == "drop":  # close the connection without answering
            self.close_connection = True
            return
        if mode in ("503", "429"):
            self.send_response(int(mode))
            if mode == "429":
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with cls.lock:
            cls.inflight += 1
            cls.max_inflight = max(cls.max_inflight, cls.inflight)
        time.sleep(0.05)
        prompt = body["messages"][-1]["content"]
        expr = re.match(r"Evaluate (.*) \(brackets first", prompt).group(1)
        assert re.fullmatch(r"[0-9+\-*() ]+", expr)
        answer = str(eval(expr))  # noqa: S307 - digits and operators only, checked above
        out = {"choices": [{"message": {"role": "assistant", "content": answer, "reasoning_content": f"{expr} = {answer}"}}],
               "usage": {"completion_tokens": 7}}
        data = json.dumps(out).encode()
        with cls.lock:
            cls.inflight -= 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server() -> Any:
    class H(_Scripted):
        failures = ["503", "429", "drop"]
        bodies: list[dict[str, Any]] = []
        count = inflight = max_inflight = 0
        lock = threading.Lock()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    th.start()
    yield srv, H
    srv.shutdown()
    srv.server_close()


def test_endpoint_teacher_retries_and_concurrency(server: Any, tmp_path: Path) -> None:
    srv, handler = server
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    teacher = EndpointTeacher(url, "scripted", concurrency=3, retries=4, backoff_s=0.01)
    out = tmp_path / "ep.jsonl"
    samples = synthesize(ARITH, teacher, effort="high", n=6, seed=2, out=out)
    assert teacher.stats.requests == 6 and teacher.stats.retries == 3 and teacher.stats.failures == 0
    assert handler.count == 9 and 2 <= handler.max_inflight <= 3
    assert all(b["reasoning_effort"] == "high" and b["model"] == "scripted" for b in handler.bodies)
    rep = verify_samples(samples, _ctx())
    assert len(rep.kept) == 6, rep.funnel.table()
    s = rep.kept[0]
    assert s["teacher"] == f"endpoint:scripted@{url}" and s["tokens"]["output"] == 7 and s["messages"][-1]["num_tokens"] == 7
    assert len(read_jsonl(out)) == 6


def test_synth_cli_with_an_endpoint_teacher(server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    srv, handler = server
    out = tmp_path / "cli.jsonl"
    ns = _parser().parse_args(["synth", "--family", "general.arithmetic", "--effort", "max", "--n", "2", "--out", str(out),
                               "--teacher-url", f"http://127.0.0.1:{srv.server_address[1]}", "--teacher-model", "scripted",
                               "--retries", "3", "--backoff", "0.01", "--concurrency", "2"])
    assert ns.fn(ns) == 0
    assert "wrote" in capsys.readouterr().out and handler.count == 5
    assert [r["teacher"].split("@")[0] for r in read_jsonl(out)] == ["endpoint:scripted"] * 2


def test_endpoint_teacher_gives_up_and_the_sample_is_rejected(server: Any) -> None:
    srv, handler = server
    handler.failures = ["503"] * 10
    teacher = EndpointTeacher(f"http://127.0.0.1:{srv.server_address[1]}/v1", "scripted", retries=2, backoff_s=0.0)
    [s] = synthesize(ARITH, teacher, effort="low", n=1)
    assert handler.count == 3 and teacher.stats.failures == 1
    assert "HTTP 503" in s["error"]
    res = structure_stage(s, _ctx())
    assert (res.status, res.reason) == ("reject", "teacher_error")


def test_endpoint_teacher_validates_arguments() -> None:
    with pytest.raises(ValueError, match="base_url must be an http"):
        EndpointTeacher("localhost:8000", "m")
    with pytest.raises(ValueError, match="concurrency"):
        EndpointTeacher("http://127.0.0.1:1", "m", concurrency=0)


# --------------------------------------------------------------------------- local model teacher


@pytest.fixture(scope="module")
def tiny_model() -> tuple[Any, Any]:
    from k3post.stages.sft_data import default_corpus
    from k3post.models import build_tiny_moe
    from k3post.tokenizer import train_tokenizer

    tok = train_tokenizer(default_corpus(2), vocab_size=400)
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end_of_msg|>"))
    return model, tok


def _short_tasks(*operands: int) -> list[Task]:
    """Real general.arithmetic tasks with short prompts (cheap CPU forward passes)."""
    return [
        Task(f"short-{a}", "general", ARITH.name, ({"role": "user", "content": f"{a} + 2 = ?"},), ARITH.name,
             metadata={"tokens": [a, "+", 2], "expression": f"{a} + 2", "answer": a + 2})
        for a in operands
    ]


def test_local_model_teacher_garbage_is_recorded_and_rejected(tiny_model: tuple[Any, Any], tmp_path: Path) -> None:
    model, tok = tiny_model
    teacher = LocalModelTeacher(model=model, tokenizer=tok, sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=0))
    tasks = _short_tasks(3, 4)
    samples = synthesize(ARITH, teacher, effort="low", n=2, seed=0, out=tmp_path / "local.jsonl", tokenizer=tok, tasks=tasks)
    assert len(read_jsonl(tmp_path / "local.jsonl")) == 2
    for s in samples:
        last = s["messages"][-1]
        assert s["teacher"].startswith("local:") and s["error"] is None and last["role"] == "assistant"
        assert 1 <= last["num_tokens"] <= 6 and s["tokens"]["method"] == "xtml"
    rep = verify_samples(samples, VerifyContext(tokenizer=tok))
    assert not rep.kept and len(rep.rejected) == 2
    assert {f["stage"] for _, f in rep.rejected} <= {"structure", "outcome"}
    assert rep.funnel.stages["structure"].seen == 2


def test_local_model_teacher_greedy_matches_hf_generate(tiny_model: tuple[Any, Any]) -> None:
    """Concurrent turns decode together in the teacher's engine, and greedy completions equal HF
    ``generate`` greedy (one unpadded prompt at a time, stop on <|end_of_msg|>) token for token."""
    import asyncio

    import torch

    model, tok = tiny_model
    x = XTML(tok)
    teacher = LocalModelTeacher(model=model, tokenizer=tok, sampling=SamplingParams(max_tokens=10, temperature=0.0), concurrency=4)
    prompts = [x.render(list(t.messages), effort=e, add_generation_prompt=True).ids
               for t, e in zip(_short_tasks(3, 41, 5, 777), ("low", "max", "high", "low"))]

    async def all_at_once() -> list[list[int]]:
        return list(await asyncio.gather(*(teacher.generate(p, seed=i) for i, p in enumerate(prompts))))

    got = asyncio.run(all_at_once())
    ref = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10,
                                 do_sample=False, eos_token_id=x.eom_id, pad_token_id=x.pad_id)
        row = out[0, len(p):].tolist()
        ref.append(row[: row.index(x.eom_id) + 1] if x.eom_id in row else row)
    assert got == ref
    # one prefill step gave every prompt its first token, then each step decoded all the live ones
    assert teacher.engine.stats["steps"] == max(map(len, got)) and not teacher.engine.has_unfinished()


def test_local_model_teacher_samples_do_not_depend_on_concurrency(tiny_model: tuple[Any, Any]) -> None:
    """Turn t of a task at an effort is seeded from (sampling seed, task id, effort, t): the same
    trajectories whether episodes run one at a time or together; another seed gives others."""
    model, tok = tiny_model
    tasks = _short_tasks(3, 4, 5)

    def run(concurrency: int, seed: int = 0, order: list[Task] = tasks) -> dict[str, Any]:
        sp = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
        teacher = LocalModelTeacher(model=model, tokenizer=tok, sampling=sp, concurrency=concurrency)
        samples = synthesize(ARITH, teacher, effort="high", n=3, seed=0, tokenizer=tok, tasks=order)
        return {s["task_id"]: s["messages"] for s in samples}

    one = run(1)
    assert run(3) == one
    assert run(1, order=tasks[::-1]) == one  # not the order of requests either
    assert run(3, seed=1) != one
    with pytest.raises(ValueError, match="concurrency"):
        LocalModelTeacher(model=model, tokenizer=tok, concurrency=0)


def test_engine_batcher_cancelled_and_abandoned_requests_leave_the_engine(tiny_model: tuple[Any, Any]) -> None:
    """A waiter cancelled mid-run has its request aborted (the other finishes); requests left by
    an event loop closed mid-run are aborted when a new loop uses the batcher."""
    import asyncio

    from k3post.rollout import EmbeddedEngine, GenerationRequest
    from k3post.rollout import SamplingParams as EngineSampling
    from k3post.synth.teachers import EngineBatcher

    model, tok = tiny_model
    engine = EmbeddedEngine(model, tok, max_batch_size=2)
    batcher = EngineBatcher(engine)

    def req(rid: str, n: int) -> GenerationRequest:
        return GenerationRequest(rid, [7, 8, 9], EngineSampling(temperature=0.0, max_tokens=n, stop_ids=()))

    async def cancel_one() -> int:
        long = asyncio.create_task(batcher.generate(req("long", 50)))
        short = asyncio.create_task(batcher.generate(req("short", 3)))
        for _ in range(4):
            await asyncio.sleep(0)
        long.cancel()
        res = await short
        with pytest.raises(asyncio.CancelledError):
            await long
        return res.num_tokens

    assert asyncio.run(cancel_one()) == 3
    assert not engine.has_unfinished() and engine.stats["decode_tokens"] < 50

    loop = asyncio.new_event_loop()
    orphan = loop.create_task(batcher.generate(req("orphan", 50)))
    for _ in range(3):
        loop.run_until_complete(asyncio.sleep(0))
    loop.close()  # mid-run, without cancelling its tasks
    orphan._log_destroy_pending = False  # type: ignore[attr-defined]  # abandoned on purpose
    assert engine.has_unfinished()
    assert asyncio.run(batcher.generate(req("next", 2))).num_tokens == 2
    assert not engine.has_unfinished() and engine.num_paused == 0


def test_local_model_teacher_parses_a_wellformed_completion(tiny_model: tuple[Any, Any]) -> None:
    """The generate → parse path with a generator that writes the right answer in XTML (the
    rollout engine's interface: prompt ids in, completion ids out)."""
    model, tok = tiny_model
    x = XTML(tok)

    class Answering(LocalModelTeacher):
        async def generate(self, prompt_ids: list[int], seed: int) -> list[int]:
            text = x.tokenizer.decode(prompt_ids)
            expr = re.search(r"Evaluate (.*) \(brackets first", text).group(1)
            full = x.render([{"role": "assistant", "reasoning_content": "r", "content": str(eval(expr))}],  # noqa: S307
                            effort=OMIT_EFFORT).ids  # the assistant message alone, from its header
            prefix = x.generation_prefix()
            assert prompt_ids[-len(prefix):] == prefix
            return full[len(prefix):]

    [s] = synthesize(ARITH, Answering(model=model, tokenizer=tok), effort="max", n=1, seed=4, tokenizer=tok)
    assert s["verdict"]["reward"] == 1.0 and s["messages"][-1]["reasoning_content"] == "r"
    assert len(verify_samples([s], VerifyContext(tokenizer=tok)).kept) == 1


# --------------------------------------------------------------------------- mixing


def test_allocate_largest_remainder() -> None:
    # shares 6.67 / 3.33 → floors 6 / 3, the leftover one goes to the larger remainder
    assert allocate({"general/low": 10, "agents/low": 10}, {"general": 2, "agents": 1}, 10) == {"general/low": 7, "agents/low": 3}
    assert group_weight({"general/max": 3, "general": 2, "*/max": 5, "*": 1}, "general/max") == 3
    assert group_weight({"general": 2, "*/max": 5}, "general/max") == 2
    assert group_weight({"*/max": 5, "*": 1}, "coding/max") == 5
    assert group_weight({"agents": 1}, "coding/low") == 0
    assert group_weight({}, "coding/low") == 1


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.dictionaries(st.sampled_from(["general/low", "general/max", "agents/high", "coding/low"]), st.integers(1, 30), min_size=1),
    weights=st.dictionaries(st.sampled_from(["general", "*/low", "agents/high", "*"]), st.floats(0.1, 5.0), min_size=1),
    n=st.integers(0, 200),
)
def test_allocate_properties(sizes: dict[str, int], weights: dict[str, float], n: int) -> None:
    """Shares sum to n and each is within 1 of its exact proportional share."""
    w = {g: group_weight(weights, g) for g in sizes}
    if n > 0 and sum(w.values()) == 0:
        with pytest.raises(ValueError):
            allocate(sizes, weights, n)
        return
    got = allocate(sizes, weights, n)
    total = sum(w.values())
    if total == 0:  # n == 0: nothing to give
        assert set(got.values()) <= {0}
        return
    assert sum(got.values()) == n
    for g, k in got.items():
        assert abs(k - n * w[g] / total) < 1


def test_mix_weights_upsampling_and_determinism(tmp_path: Path) -> None:
    pool = [{"id": f"g{i}", "domain": "general", "effort": "low"} for i in range(10)]
    pool += [{"id": f"a{i}", "domain": "agents", "effort": "max"} for i in range(2)]
    m = mix(pool, {"general": 1, "agents/max": 1}, n=8, seed=0)
    assert len(m) == 8 and sum(s["domain"] == "agents" for s in m) == 4
    agents = sorted(s["id"] for s in m if s["domain"] == "agents")
    assert agents == ["a0", "a0", "a1", "a1"]  # upsampled: two full passes over the group
    assert len({s["id"] for s in m if s["domain"] == "general"}) == 4  # without replacement
    assert mix(pool, {"general": 1, "agents/max": 1}, n=8, seed=0) == m
    assert mix(pool, {"general": 1, "agents/max": 1}, n=8, seed=1) != m
    assert len(mix(pool)) == 12
    with pytest.raises(ValueError, match="weight 0"):
        mix(pool, {"coding": 1}, n=3)
    with pytest.raises(ValueError, match=r"weights\['general'\]"):
        mix(pool, {"general": -1})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(s) + "\n" for s in pool[:10]))
    b.write_text("".join(json.dumps(s) + "\n" for s in pool[10:]))
    path, counts = mix_files([a, b], tmp_path / "m.jsonl", {"*": 1}, 6, 0)
    assert counts == {"agents/max": 3, "general/low": 3} and len(read_jsonl(path)) == 6


def test_mix_config_errors_name_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "mix.yaml"
    cfg.write_text("inputs: [a.jsonl]\nn: 5\nweigths: {general: 1}\n")
    with pytest.raises(ValueError, match=r"mix\.yaml: unknown mix config key 'weigths' \(did you mean 'weights'\?\)"):
        load_mix_config(cfg)
    cfg.write_text("weights: {general: fast}\n")
    with pytest.raises(ValueError, match=r"mix\.yaml: weights\['general'\]"):
        load_mix_config(cfg)
    cfg.write_text("out: o.jsonl\nn: 4\nseed: 3\nweights: {'general/low': 2}\n")
    c = load_mix_config(cfg)
    assert (c.out, c.n, c.seed, c.weights) == ("o.jsonl", 4, 3, {"general/low": 2.0})


def test_synth_from_config_mixes(tmp_path: Path) -> None:
    from k3post.synth import SynthConfig, synth_from_config

    cfg = SynthConfig(families=["general.arithmetic", "general.faithfulness"], efforts=["low", "max"], n_per=3,
                      mix_weights={"*/max": 3, "*/low": 1}, mix_n=8)
    path, funnel = synth_from_config(cfg, tmp_path / "sft.jsonl", seed=0)
    recs = read_jsonl(path)
    assert funnel.final["keep"] == 12 and len(recs) == 8
    assert sum(r["effort"] == "max" for r in recs) == 6


def test_hf_datasets_loads_the_output(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path, _ = build_sft_dataset([ARITH, WRITING], ["low", "max"], 2, 0, tmp_path / "sft.jsonl")
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    assert len(ds) == 8 and ds[0]["messages"][0]["role"] == "user"


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3post")
    sub = p.add_subparsers(dest="command", required=True)
    add_synth_parser(sub)
    add_mix_parser(sub)
    return p


def test_synth_and_mix_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.jsonl"
    ns = _parser().parse_args(["synth", "--family", "general.arithmetic,general.writing", "--effort", "low,max", "--n", "2",
                               "--out", str(out), "--budget", "max=3"])
    assert ns.fn(ns) == 0
    text = capsys.readouterr().out
    assert re.search(r"quality\s+8\s+4\s+4\s+0\s+over_budget×4", text), text
    assert len(read_jsonl(out)) == 4
    mixed = tmp_path / "m.jsonl"
    ns = _parser().parse_args(["mix", "--in", str(out), "--out", str(mixed), "--weight", "general/low=1", "--n", "3"])
    assert ns.fn(ns) == 0
    assert [r["effort"] for r in read_jsonl(mixed)] == ["low"] * 3
    for argv, msg in (
        (["synth", "--family", "general.arithmatic", "--n", "1", "--out", str(out)], "did you mean 'general.arithmetic'"),
        (["synth", "--family", "general.arithmetic", "--effort", "medium", "--n", "1", "--out", str(out)], "unknown effort 'medium'"),
        (["synth", "--family", "general.arithmetic", "--n", "1", "--out", str(out), "--teacher-url", "http://x"], "needs --teacher-model"),
        (["synth", "--family", "general.arithmetic", "--n", "1", "--out", str(out), "--budget", "low=many"], "not a valid int"),
    ):
        ns = _parser().parse_args(argv)
        with pytest.raises(ValueError, match=re.escape(msg)):
            ns.fn(ns)


def test_find_family() -> None:
    assert find_family("general.writing") is WRITING
    with pytest.raises(ValueError, match="unknown task family"):
        find_family("general.nope")
