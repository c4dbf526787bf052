"""Engine servers over HTTP: the engine API of `k3post serve` (k3post.serve.engine_api) and the
`HTTPEngine` client (k3post.rollout.http_engine) driving the partial-rollout scheduler.

Real processes on loopback: three ``python -m k3post serve`` subprocesses (A, B, C) over a tiny
fp32 Qwen3-MoE saved to a temporary folder, one torch thread each. The in-process reference is
an `EmbeddedEngine` over the same folder. Checks:

* ``/generate`` equals the in-process engine (tokens and log-probs, same seed), also as a
  continuation; ``/abort_request`` returns the partial output; ``/pause_generation`` stops
  stepping and ``/continue_generation`` finishes the same tokens; ``/update_weights_from_disk``
  (a Hugging Face checkpoint, then tensors by name through `HTTPEngine.update_weights`)
  changes the outputs and the version, a bad weight file leaves both untouched (server C);
* the scheduler over two servers (A, B): with λ = 1 the batches equal the in-process
  scheduler's token for token; with λ = 0.7 and heavy-tailed lengths every trajectory is
  dispatched once, each iteration only extends what a trajectory had, and the final tokens
  equal an uninterrupted in-process run;
* faults: server C is killed mid-iteration; its requests are re-routed to A and complete with
  the reference tokens; a client with no reachable server fails naming the URLs.

Shape legend: none (token lists).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from k3post.distributed.weight_sync import DiskSync
from k3post.envs.families.registry import get_family
from k3post.models import build_tiny_moe, load_model, save_model
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.embedded.exact import exact_forward_for
from k3post.rollout.agent_loop import AgentLoop
from k3post.rollout.engine import GenerationRequest
from k3post.rollout.http_engine import EngineUnavailableError, HTTPEngine
from k3post.rollout.scheduler import PartialRolloutScheduler
from k3post.serve.launch import LocalServers
from k3post.rollout.trajectory import Group, Trajectory
from k3post.routing_replay import decode_routes
from k3post.xtml import EOM, XTML

pytest.importorskip("uvicorn")

FAM = get_family("general.arithmetic")
TOL = 1e-5  # log-prob tolerance of tests/test_partial_rollout.py (batch composition moves last bits)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Server:
    """A `k3post serve` process of `LocalServers`, with call helpers."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body or {}, timeout=120)

    def get(self, path: str) -> dict[str, Any]:
        return httpx.get(self.url + path, timeout=30).json()


@contextlib.contextmanager
def running_servers(model_dir: Path, logs: Path, names: str, *, qat: bool = False,
                    record_routes: bool = False, exact: bool = False) -> Iterator[dict[str, Server]]:
    """Servers named by the letters of ``names`` (4 slots, one torch thread each), ready; stopped on exit."""
    with LocalServers(model_dir, len(names), max_batch_size=4, qat=qat, threads=1, log_dir=logs,
                      record_routes=record_routes, exact=exact) as ls:
        yield {name: Server(p.url, p.proc, p.log) for name, p in zip(names, ls.servers)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Path:
    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    return save_model(model, tmp_path_factory.mktemp("http") / "tiny", tok)


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Servers A and B (never modified) and C (weights updated, then killed)."""
    with running_servers(model_dir, tmp_path_factory.mktemp("logs"), "ABC") as out:
        yield out


def _local(model_dir: Path, slots: int = 4) -> EmbeddedEngine:
    return EmbeddedEngine(model_dir, max_batch_size=slots, seed=0)


def _generate(s: Server, prompt: list[int], sp: SamplingParams, *, rid: str | None = None,
              continuation: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                            "max_new_tokens": sp.max_tokens, "seed": sp.seed, "ignore_eos": sp.ignore_eos},
    }
    if rid is not None:
        body["rid"] = rid
    if continuation is not None:
        body["continuation"] = continuation
    r = s.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_routes_come_back_over_http(servers: dict[str, Server], model_dir: Path, tmp_path: Path) -> None:
    """k3post serve --record-routes returns every fed position's experts in /generate's meta_info.routes: bit for bit
    the routes an in-process engine records for the same request (same model, same forwards), also through
    `HTTPEngine`; a client that asks servers without the flag fails naming it, and a dialect that cannot say
    fails at construction."""
    sp = SamplingParams(max_tokens=12, seed=3)
    [ref] = EmbeddedEngine(model_dir, max_batch_size=4, seed=0, record_routes=True).generate(
        [GenerationRequest("r", PROMPT, sp)])
    assert ref.routes is not None and len(ref.routes) == len(PROMPT) + ref.num_tokens - 1
    with running_servers(model_dir, tmp_path, "R", record_routes=True) as srv:
        d = _generate(srv["R"], PROMPT, sp)
        assert d["output_ids"] == ref.output_ids and torch.equal(decode_routes(d["meta_info"]["routes"]), ref.routes)
        with HTTPEngine([srv["R"].url], record_routes=True) as eng:
            [got] = eng.generate([GenerationRequest("h", PROMPT, sp)])
        assert got.output_ids == ref.output_ids and torch.equal(got.routes, ref.routes)
    assert "routes" not in _generate(servers["A"], PROMPT, sp)["meta_info"]
    with HTTPEngine([servers["A"].url], record_routes=True, max_retries=0) as eng:
        with pytest.raises(Exception, match="--record-routes"):
            eng.generate([GenerationRequest("h", PROMPT, sp)])
    with pytest.raises(ValueError, match="record_routes"):
        HTTPEngine([servers["A"].url], record_routes=True, dialect="sglang")


def test_an_exact_server_records_the_trainers_log_probs(model_dir: Path, tmp_path: Path) -> None:
    """k3post serve --exact (rl.rollout.exact over engine.kind http): whatever batches the server forms from concurrent
    requests, every log-prob it returns is the trainer's exact recomputation in this process, bit for bit."""
    model = load_model(model_dir)
    apply_qat(model, QATConfig())
    reqs = [GenerationRequest(f"x{i}", PROMPT[: 3 + 2 * i], SamplingParams(max_tokens=10 + 3 * i, seed=i)) for i in range(5)]
    with running_servers(model_dir, tmp_path, "X", qat=True, exact=True) as srv:
        with HTTPEngine([srv["X"].url]) as eng:
            got = eng.generate(reqs)
    for r in got:
        ids = r.prompt_ids + r.output_ids
        lp = exact_forward_for(model, len(ids)).token_logprobs(torch.tensor([ids]))[0]
        assert r.output_logprobs == lp[len(r.prompt_ids):].tolist(), r.request_id


def _lp(d: dict[str, Any]) -> list[float]:
    return [x[0] for x in d["meta_info"]["output_token_logprobs"]]


PROMPT = [5, 17, 42, 99, 120, 7, 64]


# --------------------------------------------------------------------------- (a) the endpoints


def test_generate_equals_embedded_engine_and_continuation(servers: dict[str, Server], model_dir: Path) -> None:
    a = servers["A"]
    local = _local(model_dir)
    cases = [SamplingParams(max_tokens=20, seed=3), SamplingParams(max_tokens=20, seed=4, temperature=0.7, top_k=20, top_p=0.9),
             SamplingParams(max_tokens=12, seed=5, temperature=0.0)]
    for i, sp in enumerate(cases):
        d = _generate(a, PROMPT, sp)
        [ref] = local.generate([GenerationRequest(f"r{i}", PROMPT, sp)])
        meta = d["meta_info"]
        assert d["output_ids"] == ref.output_ids and _lp(d) == ref.output_logprobs  # bit for bit
        assert [x[1] for x in meta["output_token_logprobs"]] == ref.output_ids
        assert meta["versions"] == [0] * ref.num_tokens and meta["weight_version"] == 0
        assert meta["kv_versions"] == [0] * ref.num_tokens
        assert meta["finish_reason"]["type"] == ref.finish_reason and meta["completion_tokens"] == ref.num_tokens
        assert isinstance(d["text"], str)
        # resume after 7 tokens (recorded log-probs and versions travel with them): the same output
        k = 7
        cont = {"output_ids": ref.output_ids[:k], "output_logprobs": ref.output_logprobs[:k], "output_versions": [0] * k}
        c = _generate(servers["B"], PROMPT, sp, continuation=cont)
        assert c["output_ids"] == ref.output_ids and c["meta_info"]["given_tokens"] == k
        assert c["meta_info"]["kv_versions"] == [-1] * k + [0] * (ref.num_tokens - k)  # the server sampled the rest
        assert _lp(c)[:k] == ref.output_logprobs[:k]  # the recorded ones, as sent
        # the re-prefill computes position k in a prefill forward, not a decode step: last bits may move
        assert max(abs(x - y) for x, y in zip(_lp(c), ref.output_logprobs)) < TOL
    info = a.get("/get_model_info")
    assert info["model_path"] == model_dir.resolve().name and info["kv_transfer"] is False and info["max_batch_size"] == 4
    assert a.get("/get_weight_version") == {"weight_version": 0} and a.get("/health")["engine"]["weight_version"] == 0
    bad = a.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "min_p": 0.1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.min_p"
    bad = a.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4},
                               "continuation": {"output_ids": [1, 2], "output_logprobs": [0.0], "output_versions": [0, 0]}})
    assert bad.status_code == 400 and "given_logprobs (1)" in bad.json()["error"]["message"]


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    t.start()
    return t, box


def _wait_steps(s: Server, n: int) -> int:
    deadline = time.time() + 60
    while (steps := s.get("/health")["engine"]["steps"]) < n:
        assert time.time() < deadline
        time.sleep(0.05)
    return int(steps)


def _wait_admitted(s: Server, n: int) -> None:
    """Until the engine holds ``n`` requests (queued or running); admission runs while generation is paused."""
    deadline = time.time() + 60
    while (h := s.get("/health")["engine"])["num_queued"] + h["num_running"] < n:
        assert time.time() < deadline
        time.sleep(0.05)


def test_abort_returns_partial_and_pause_continue(servers: dict[str, Server], model_dir: Path) -> None:
    """Abort returns the partial output; pause stops stepping with the request's state kept, continue goes on
    from it (the same tokens as an uninterrupted run) and finishes.

    Nothing races generation: each request is submitted while generation is paused, the abort is sent while
    paused (so its partial output is exactly what was sampled), and a running request is paused 20 steps
    into 1,500 (the only wait on a running engine: ~1,480 steps of margin, where the old version paused a
    150-token request 5 steps in and failed under CPU load when it finished first)."""
    a = servers["A"]
    local = _local(model_dir)
    try:
        long = SamplingParams(max_tokens=1500, seed=9, ignore_eos=True)
        assert a.post("/pause_generation").json() == {"success": True}
        steps0 = a.get("/health")["engine"]["steps"]
        t, box = _in_thread(lambda: _generate(a, PROMPT, long, rid="long-1"))
        _wait_admitted(a, 1)
        assert a.post("/continue_generation").json() == {"success": True}
        _wait_steps(a, steps0 + 20)
        # pause mid-generation: no step runs, the request stays in its slot
        assert a.post("/pause_generation").json() == {"success": True}
        h1 = a.get("/health")["engine"]
        time.sleep(0.5)
        h2 = a.get("/health")["engine"]
        assert h1["generation_paused"] and h1["steps"] == h2["steps"] and h2["num_running"] == 1 and t.is_alive()
        # continue from that state for 20 more steps, then abort it while paused
        assert a.post("/continue_generation").json() == {"success": True}
        _wait_steps(a, h2["steps"] + 20)
        assert a.post("/pause_generation").json() == {"success": True}
        assert a.post("/abort_request", {"rid": "long-1"}).json() == {"success": True}
        t.join(60)
        d = box["result"]
        n = len(d["output_ids"])
        assert d["meta_info"]["finish_reason"]["type"] == "abort" and 40 <= n < 1500, (d["meta_info"], n)
        [ref] = local.generate([GenerationRequest("p", PROMPT, SamplingParams(max_tokens=n, seed=9, ignore_eos=True))])
        assert d["output_ids"] == ref.output_ids and _lp(d) == ref.output_logprobs
        assert a.post("/abort_request", {"rid": "no-such-request"}).status_code == 200  # finished or unknown: ignored

        # submitted while paused: queued, no step runs; continue: it finishes with the uninterrupted tokens
        sp = SamplingParams(max_tokens=150, seed=10, ignore_eos=True)
        steps1 = a.get("/health")["engine"]["steps"]
        t, box = _in_thread(lambda: _generate(a, PROMPT, sp))
        _wait_admitted(a, 1)
        time.sleep(0.5)
        assert a.get("/health")["engine"]["steps"] == steps1 and t.is_alive()
        assert a.post("/continue_generation").json() == {"success": True}
        t.join(60)
        [ref] = local.generate([GenerationRequest("q", PROMPT, sp)])
        assert box["result"]["output_ids"] == ref.output_ids and _lp(box["result"]) == ref.output_logprobs
        assert not a.get("/health")["engine"]["generation_paused"]
        assert a.post("/flush_cache").json()["success"] is True
    finally:  # never leave the shared server paused for the tests after this one
        a.post("/continue_generation")


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_update_weights_from_disk(servers: dict[str, Server], model_dir: Path, tmp_path: Path, xtml_tokenizer: Any) -> None:
    c = servers["C"]
    sp = SamplingParams(max_tokens=16, seed=21)
    v0 = c.get("/get_weight_version")["weight_version"]
    out0 = _generate(c, PROMPT, sp)
    tok = xtml_tokenizer
    other = build_tiny_moe(len(tok), seed=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    other_dir = save_model(other, tmp_path / "other", tok)  # a Hugging Face checkpoint folder

    r = c.post("/update_weights_from_disk", {"model_path": str(other_dir), "weight_version": v0 + 1})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == v0 + 1
    out1 = _generate(c, PROMPT, sp)
    [ref1] = _local(other_dir).generate([GenerationRequest("o", PROMPT, sp)])
    assert out1["output_ids"] != out0["output_ids"]
    assert out1["output_ids"] == ref1.output_ids and _lp(out1) == ref1.output_logprobs
    assert out1["meta_info"]["versions"] == [v0 + 1] * len(out1["output_ids"])

    # bad inputs: wrong shape, non-finite values, a corrupt file, an unknown tensor, an old version;
    # each is refused with the file / key named, and neither weights nor version change
    good = _named(_local(model_dir).model)
    names = sorted(good)
    cases: list[tuple[str, dict[str, torch.Tensor] | bytes, str]] = [
        ("shape", {**good, names[3]: torch.zeros(3, 3)}, f"tensor '{names[3]}' has shape (3, 3)"),
        ("nan", {**good, names[5]: torch.full_like(good[names[5]], float("nan"))}, f"tensor '{names[5]}' holds non-finite"),
        ("corrupt", b"\x00" * 64, "not a readable safetensors file"),
        ("unknown", {"model.no_such.weight": torch.zeros(2)}, "tensor 'model.no_such.weight' is not a parameter"),
    ]
    for what, content, message in cases:
        folder = tmp_path / what
        folder.mkdir()
        f = folder / "weights-00001.safetensors"
        if isinstance(content, bytes):
            f.write_bytes(content)
        else:
            save_file(content, str(f))
        r = c.post("/update_weights_from_disk", {"model_path": str(folder)})
        body = r.json()
        assert r.status_code == 400 and not body["success"], what
        assert message in body["message"] and "weights-00001.safetensors" in body["message"], (what, body)
        assert body["weight_version"] == v0 + 1
    r = c.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": v0 + 1})
    assert r.status_code == 400 and "must exceed the current version" in r.json()["message"]
    assert c.get("/get_weight_version")["weight_version"] == v0 + 1
    still = _generate(c, PROMPT, sp)
    assert still["output_ids"] == out1["output_ids"] and _lp(still) == _lp(out1)

    # the client's path: tensors by name -> safetensors -> every server; back to the first weights
    with HTTPEngine([c.url]) as eng:
        assert eng.version == v0 + 1
        assert eng.update_weights(good) == v0 + 2 and eng.version == v0 + 2
    back = _generate(c, PROMPT, sp)
    assert back["output_ids"] == out0["output_ids"] and _lp(back) == _lp(out0)
    assert back["meta_info"]["weight_version"] == v0 + 2

    # a DiskSync version folder with a corrupted shard: refused (sha256), nothing changes
    stats = DiskSync(tmp_path / "sync").push(other.named_parameters(), v0 + 3)
    shard = sorted(Path(stats.location).glob("shard-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    r = c.post("/update_weights_from_disk", {"model_path": stats.location})
    assert r.status_code == 400 and shard.name in r.json()["message"] and "sha256" in r.json()["message"]
    assert c.get("/get_weight_version")["weight_version"] == v0 + 2
    again = _generate(c, PROMPT, sp)
    assert again["output_ids"] == out0["output_ids"] and _lp(again) == _lp(out0)


# --------------------------------------------------------------------------- (b) the scheduler over two servers


def pareto_sampling(traj: Trajectory, turn: int) -> SamplingParams:
    """max_tokens ~ Pareto(x_m = 3, alpha = 1.1) capped at 120, drawn from the trajectory seed."""
    u = random.Random(traj.seed * 31 + turn).random()
    return SamplingParams(max_tokens=min(120, int(3 * (1.0 - u) ** (-1 / 1.1))), ignore_eos=True)


def _loop(engine: Any, tok: Any, **kw: Any) -> AgentLoop:
    return AgentLoop(engine, XTML(tok), FAM.make_env, **kw)


def _flat(groups: list[Group]) -> dict[str, Trajectory]:
    return {t.traj_id: t for g in groups for t in g.trajectories}


def _max_lp_diff(a: Trajectory, b: Trajectory) -> float:
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)


def test_lambda_one_two_servers_equal_in_process(servers: dict[str, Server], model_dir: Path, xtml_tokenizer: Any) -> None:
    tasks = FAM.generate(6, seed=11)
    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    runs = {}
    with HTTPEngine([servers["A"].url, servers["B"].url]) as remote:
        for name, engine in (("http", remote), ("local", _local(model_dir))):
            sch = PartialRolloutScheduler(_loop(engine, xtml_tokenizer, sampling=sampling), n_prompts=3, k=2,
                                          lambda_=1.0, seed=5)
            runs[name] = [sch.run_iteration(tasks[:3]), sch.run_iteration(tasks[3:])]
            assert not sch.trajectories() and sch.stats["pauses"] == 0
        assert set(remote.calls_per_server) == {servers["A"].url, servers["B"].url}  # both servers worked
    worst = 0.0
    for it in range(2):
        got, ref = _flat(runs["http"][it]), _flat(runs["local"][it])
        assert sorted(got) == sorted(ref) and len(got) == 6
        for tid, t in got.items():
            r = ref[tid]
            assert t.token_ids == r.token_ids, tid  # bit-identical tokens
            assert t.versions == r.versions and t.trainable == r.trainable and t.finish == r.finish and t.reward == r.reward
            assert t.kv_versions == r.kv_versions  # the servers' KV versions travel back with the tokens
            worst = max(worst, _max_lp_diff(t, r))
    print(f"lambda=1, two servers vs in-process: max |logprob diff| = {worst:.3g}")
    assert worst < TOL


def test_lambda_07_two_servers_nothing_lost_or_duplicated(servers: dict[str, Server], model_dir: Path,
                                                          xtml_tokenizer: Any) -> None:
    with HTTPEngine([servers["A"].url, servers["B"].url]) as remote:
        sch = PartialRolloutScheduler(_loop(remote, xtml_tokenizer, sampling_fn=pareto_sampling), n_prompts=4, k=3,
                                      lambda_=0.7, seed=1)
        sch.add_prompts(FAM.generate(12, seed=2))
        seen: dict[str, tuple[list[int], list[float], list[int]]] = {}
        groups: list[Group] = []
        for _ in range(200):
            if not sch.trajectories() and not sch.num_pending_prompts:
                break
            new = sch.run_iteration()
            groups += new
            # every trajectory only extends what it had (tokens, log-probs and versions kept)
            for t in sch.trajectories() + [t for g in new for t in g.trajectories]:
                old = seen.get(t.traj_id)
                if old is not None:
                    n = len(old[0])
                    assert (t.token_ids[:n], t.logprobs[:n], t.versions[:n]) == old, t.traj_id
                seen[t.traj_id] = (list(t.token_ids), list(t.logprobs), list(t.versions))
        assert remote.stats["pauses"] > 0 and not remote.has_unfinished()
    ids = [t.traj_id for g in groups for t in g.trajectories]
    assert len(ids) == len(set(ids)) == 12 * 3  # none lost, none duplicated
    assert sorted(g.group_id for g in groups) == list(range(12))
    pauses = [t.pauses for g in groups for t in g.trajectories]
    print(f"lambda=0.7, two servers: {len(groups)} groups, pauses per trajectory {sorted(pauses)}, engine {remote.stats}")
    # the first iteration (12 fresh trajectories) stops at ceil(0.7 * 12) = 9 completions and pauses those still
    # running; later ones pause more. How many depends on timing: completions arrive in bunches on a busy machine
    # (2 pauses in all with the full suite running beside it, 9 alone), so only "some" is certain: the heavy-tailed
    # lengths (pareto_sampling) leave a long one running
    assert sum(pauses) >= 1
    # the tokens of an uninterrupted in-process run
    fresh = [Trajectory(traj_id=t.traj_id, group_id=t.group_id, sample_index=t.sample_index, seed=t.seed, task=t.task)
             for g in groups for t in g.trajectories]
    _loop(_local(model_dir, slots=8), xtml_tokenizer, sampling_fn=pareto_sampling).run(fresh)
    for t, r in zip((t for g in groups for t in g.trajectories), fresh):
        assert t.token_ids == r.token_ids and t.versions == r.versions and t.finish == r.finish, t.traj_id
        assert _max_lp_diff(t, r) < TOL


# --------------------------------------------------------------------------- (c) faults


def two_lengths(traj: Trajectory, turn: int) -> SamplingParams:
    """Sample 0 of a group stops at 40 tokens, sample 1 at 100 (ignore_eos)."""
    return SamplingParams(max_tokens=40 + 60 * traj.sample_index, ignore_eos=True)


def _assert_two_lengths_uninterrupted(groups: list[Group], model_dir: Path, tok: Any) -> None:
    """The 8 trajectories of 4 tasks x 2 samples under `two_lengths` ended, each with the tokens (and, within TOL,
    log-probs) an uninterrupted in-process run samples."""
    got = _flat(groups)
    assert len(got) == 8 and all(t.done and t.num_sampled == 40 + 60 * t.sample_index for t in got.values())
    fresh = [Trajectory(traj_id=t.traj_id, group_id=t.group_id, sample_index=t.sample_index, seed=t.seed, task=t.task)
             for t in got.values()]
    _loop(_local(model_dir, slots=8), tok, sampling_fn=two_lengths).run(fresh)
    for r in fresh:
        assert got[r.traj_id].token_ids == r.token_ids, r.traj_id
        assert _max_lp_diff(got[r.traj_id], r) < TOL


def test_killed_server_requests_rerouted(servers: dict[str, Server], model_dir: Path, xtml_tokenizer: Any,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """Iteration 1 (λ = 0.5) pauses the four long trajectories after ~40 tokens; iteration 2 resumes
    them over A and C while C hangs (generation paused) and is then killed: C's continuations restart on A
    from the tokens they had, and every trajectory ends with the tokens of an uninterrupted run. (Killing C
    after a number of its steps raced with the iteration finishing first. C is killed once a continuation
    has reached it: a request on the hung C holds the iteration open, so nothing races. Waiting for two
    failed under load, because least-loaded routing sent only one there when completions came in a bunch.)"""
    a, c = servers["A"], servers["C"]
    tasks = FAM.generate(4, seed=13)
    with caplog.at_level(logging.WARNING, logger="k3post.rollout.http"):
        with HTTPEngine([a.url, c.url], max_retries=2, backoff_s=0.05) as remote:
            sch = PartialRolloutScheduler(_loop(remote, xtml_tokenizer, sampling_fn=two_lengths), n_prompts=4, k=2,
                                          lambda_=0.5, seed=3)
            groups = sch.run_iteration(tasks)
            paused = sch.paused()
            assert len(paused) == 4 and all(0 < t.num_sampled < 100 for t in paused)
            at_pause = min(t.num_sampled for t in paused)
            # C hangs (generation paused) and then dies: whatever iteration 2 sends it cannot finish there
            calls0 = remote.calls_per_server[c.url]
            assert c.post("/pause_generation").status_code == 200

            def kill_c_mid_iteration() -> None:
                deadline = time.time() + 60
                while remote.calls_per_server[c.url] < calls0 + 1:  # a continuation went to C (it hangs there)
                    assert time.time() < deadline
                    time.sleep(0.05)
                c.proc.kill()

            killer = threading.Thread(target=kill_c_mid_iteration, daemon=True)
            killer.start()
            groups += sch.run_iteration()
            killer.join(30)
            assert c.proc.poll() is not None and not sch.trajectories()
            assert remote.live_urls == [a.url] and remote.stats["dead_servers"] == 1 and remote.stats["reroutes"] >= 1
            # continuations re-routed with their tokens: each carries at least what its trajectory had at the pause
            # (how many tokens that is depends on the machine's load when iteration 1 paused, not a fixed count)
            assert remote.stats["reroute_kept_tokens"] >= remote.stats["reroutes"] * at_pause > 0
            print(f"fault: {remote.stats}")
    assert any("re-routing request" in r.getMessage() and c.url in r.getMessage() for r in caplog.records)
    assert any("marked dead" in r.getMessage() for r in caplog.records)
    _assert_two_lengths_uninterrupted(groups, model_dir, xtml_tokenizer)

    # a server refusing connections from the start is marked dead; requests go to the others
    with HTTPEngine([c.url, a.url], max_retries=1, backoff_s=0.01) as eng:
        assert eng.live_urls == [a.url] and eng.stats["dead_servers"] == 1
        sp = SamplingParams(max_tokens=12, seed=3)
        [res] = eng.generate([GenerationRequest("x", PROMPT, sp)])
        [ref] = _local(model_dir).generate([GenerationRequest("x", PROMPT, sp)])
        assert res.output_ids == ref.output_ids and res.output_logprobs == ref.output_logprobs
    # no server left: a clear error naming the URLs
    with pytest.raises(EngineUnavailableError, match=c.url.replace(".", r"\.")):
        HTTPEngine([c.url], max_retries=1, backoff_s=0.01)


def test_a_released_engine_serves_the_training_ids_and_paused_trajectories_end_as_uninterrupted(
        servers: dict[str, Server], model_dir: Path, xtml_tokenizer: Any) -> None:
    """After the last RL step the held-out evaluation runs on the rollout's engine, under the training ids
    (``g<i>/s<j>#t<k>``). A server keeps a paused request until it is resumed, so README's two-server `k3post rl` failed
    there: "request id 'g3/s0#t0' is already running or paused in this engine". `release_engine` (which `train_policy`
    calls after its last step) takes the paused requests out of the server. They lose nothing: resumed afterwards, they
    end with the tokens of an uninterrupted run."""
    from k3post.rollout.evaluation import run_episodes

    tasks = FAM.generate(4, seed=13)
    with HTTPEngine([servers["A"].url], backoff_s=0.05) as remote:
        sch = PartialRolloutScheduler(_loop(remote, xtml_tokenizer, sampling_fn=two_lengths), n_prompts=4, k=2,
                                      lambda_=0.5, seed=3)
        groups = sch.run_iteration(tasks)
        paused = sch.paused()  # the 100-token samples, 3 or 4 of them (how many end before λ is reached is timing)
        assert paused
        rid = f"{paused[0].traj_id}#t0"
        with pytest.raises(ValueError, match="already running or paused"):  # what the evaluation hit
            remote.add_request(GenerationRequest(rid, PROMPT, SamplingParams(max_tokens=4)))
        sch.release_engine()
        evaluated = run_episodes(remote, XTML(xtml_tokenizer), tasks, effort=None, max_tokens=8, samples=2)
        assert rid.split("#")[0] in {t.traj_id for ts in evaluated for t in ts}  # the same ids, now free
        groups += sch.run_iteration()
        assert not sch.trajectories() and not remote.has_unfinished()
    _assert_two_lengths_uninterrupted(groups, model_dir, xtml_tokenizer)


# --------------------------------------------------------------------------- the Rollout seam (runs last: it moves A's version)


def test_rollout_config_switch_http_equals_embedded(servers: dict[str, Server], model_dir: Path,
                                                    xtml_tokenizer: Any) -> None:
    """`Rollout` with ``engine.kind = "http"`` (server A) gives the embedded Rollout's tokens; its
    ``push_weights`` sends the trainer's weights to the server (DiskSync folder), version + 1."""
    from k3post.config.rollout import EngineConfig, RolloutConfig
    from k3post.models import load_model
    from k3post.rollout.factory import Rollout

    a = servers["A"]
    model = load_model(model_dir)
    base = dict(n_prompts=2, k=2, lambda_=1.0, max_tokens=16, slots=4)
    tasks = FAM.generate(2, seed=5)
    runs = {}
    for kind, engine in (("embedded", EngineConfig()), ("http", EngineConfig(kind="http", urls=[a.url], backoff_s=0.05))):
        ro = Rollout(model, xtml_tokenizer, RolloutConfig(**base, engine=engine), effort=None, seed=7)
        ro.add_prompts(tasks)
        runs[kind] = (ro, _flat(ro.run_iteration()))
    ro_http = runs["http"][0]
    assert isinstance(ro_http.engine, HTTPEngine)
    got, ref = runs["http"][1], runs["embedded"][1]
    assert sorted(got) == sorted(ref) and len(got) == 4
    off = ro_http.version - runs["embedded"][0].version  # the Rollout's first push: the trainer's weights, version + 1
    assert off == 1
    for tid in ref:
        assert got[tid].token_ids == ref[tid].token_ids, tid
        assert [v - off if v >= 0 else v for v in got[tid].versions] == ref[tid].versions, tid
        assert _max_lp_diff(got[tid], ref[tid]) < TOL
    v = a.get("/get_weight_version")["weight_version"]
    sp = SamplingParams(max_tokens=12, seed=3)
    before = _generate(a, PROMPT, sp)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # a "train step"
    assert ro_http.push_weights(lambda: model.named_parameters()) == v + 1
    assert a.get("/get_weight_version")["weight_version"] == v + 1
    after = _generate(a, PROMPT, sp)
    [ref_after] = EmbeddedEngine(model, max_batch_size=4, seed=0).generate([GenerationRequest("z", PROMPT, sp)])
    assert after["output_ids"] == ref_after.output_ids and _lp(after) == ref_after.output_logprobs
    assert _lp(after) != _lp(before)
    ro_http.engine.close()


# --------------------------------------------------------------------------- (d) the RL loop over servers


@pytest.fixture(scope="module")
def rl_servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two fresh servers (D, E) over the initial model, whose weights the RL loop pushes each step."""
    with running_servers(model_dir, tmp_path_factory.mktemp("rl_logs"), "DE") as out:
        yield list(out.values())


def _signs_signal(groups):
    """A signal that moves the weights every step (advantage +1 / −1 by sample parity), so a server that
    missed a push would sample from, and score with, visibly different weights."""
    from k3post.policy_step import TokenSequence

    seqs = [TokenSequence(list(t.token_ids), list(t.trainable), list(t.logprobs),
                          [(1.0 if t.sample_index % 2 == 0 else -1.0) if m else 0.0 for m in t.trainable],
                          list(t.versions))
            for g in groups for t in g.trajectories]
    return seqs, {"reward": 0.0}


def _rl_run(model_dir: Path, tok: Any, engine: Any, lambda_: float, steps: int) -> tuple[list, list[dict]]:
    from k3post.config import PolicyOptimConfig, RLConfig, RolloutConfig
    from k3post.loop import PolicyLoop
    from k3post.models import load_model

    cfg = RLConfig(seed=3, effort="max", progress=False, optim=PolicyOptimConfig(lr=1e-2),
                   rollout=RolloutConfig(n_prompts=3, k=2, lambda_=lambda_, max_tokens=24, slots=4, engine=engine))
    pl = PolicyLoop(load_model(model_dir), tok, cfg, signal=_signs_signal)
    tasks = FAM.generate(12, seed=21)
    groups, recs = [], []
    try:
        for _ in range(steps):
            recs.append(pl.step(tasks))
            groups.append(pl.last_groups)
    finally:
        pl.close()
    return groups, recs


def _same_steps(got_groups: list, got_recs: list[dict], ref_groups: list, ref_recs: list[dict]) -> int:
    """Asserts that every step of an RL run over servers trained the in-process run's trajectories (the same
    ids, tokens, versions and, within tolerance, log-probs) with the trainer–rollout gap at kernel noise;
    returns the version offset (1: the servers start one version past their own, the loop's first push
    puts the trainer's weights there)."""
    off = int(got_recs[0]["version"] - ref_recs[0]["version"])
    assert off == 1 and [r["version"] - off for r in got_recs] == [r["version"] for r in ref_recs]
    for step, (gs, rs) in enumerate(zip(got_groups, ref_groups, strict=True)):
        got, ref = _flat(gs), _flat(rs)
        assert sorted(got) == sorted(ref), step
        for tid in ref:
            assert got[tid].token_ids == ref[tid].token_ids, (step, tid)
            assert [v - off if v >= 0 else v for v in got[tid].versions] == ref[tid].versions, (step, tid)
            # step 0: the same weights, batch composition only (TOL); later the two trainers' weights differ a
            # little: behaviour log-probs 1e-6 apart change the loss that much, and Adam scales near-zero
            # gradients up to ~lr (measured 1.5e-5 after two updates)
            assert _max_lp_diff(got[tid], ref[tid]) < (TOL if step == 0 else 1e-3), (step, tid)
    for rec in got_recs:
        assert rec["train/rollout_gap_tokens"] > 0 and rec["train/rollout_gap_max"] < 1e-4, rec
    return off


def test_rl_loop_over_two_servers_equals_in_process(rl_servers: list[Server], model_dir: Path, xtml_tokenizer: Any) -> None:
    """`PolicyLoop` with ``rl.rollout.engine.kind = http`` over two server processes: at λ = 1 every step samples
    the in-process run's tokens (the servers get the trainer's weights each step: the trained version's
    train–rollout gap stays at kernel noise, the servers end at the loop's version); at λ = 0.7 every
    trajectory is trained once, none lost or duplicated."""
    from k3post.config.rollout import EngineConfig

    http = EngineConfig(kind="http", urls=[s.url for s in rl_servers], backoff_s=0.05)
    steps = 3
    ref_groups, ref_recs = _rl_run(model_dir, xtml_tokenizer, EngineConfig(), 1.0, steps)
    got_groups, got_recs = _rl_run(model_dir, xtml_tokenizer, http, 1.0, steps)
    assert _same_steps(got_groups, got_recs, ref_groups, ref_recs) == 1
    assert [r["version"] for r in ref_recs] == [1.0, 2.0, 3.0]
    assert {s.get("/get_weight_version")["weight_version"] for s in rl_servers} == {steps + 1}
    # λ = 0.7: partial rollout over the servers; every dispatched trajectory trained exactly once. One
    # trajectory in flight at a time makes the pause deterministic: the 5th of 6 completes with the 6th
    # still waiting (with all 6 in flight, the servers may finish them all between two polls: CI saw that)
    seq = dataclasses.replace(http, max_concurrency=1)
    groups, recs = _rl_run(model_dir, xtml_tokenizer, seq, 0.7, 4)
    seen = [t.traj_id for gs in groups for g in gs for t in g.trajectories]
    assert len(seen) == len(set(seen)) and all(len(g.trajectories) == 2 for gs in groups for g in gs)
    for gs in groups:
        for g in gs:
            for t in g.trajectories:
                assert t.done and len(t.logprobs) == len(t.token_ids) == len(t.versions)
    assert any(r["paused"] > 0 for r in recs)  # λ < 1 left trajectories paused across steps
    assert all(r["train/rollout_gap_max"] < 1e-4 for r in recs if r.get("train/rollout_gap_tokens", 0) > 0)
