"""``engine.kind = http`` with ``engine.launch``: every engine a stage builds runs in local ``k3post serve``
processes of its own (`k3post.serve.launch.LocalServers` through `build_engine`), with the tokens and
log-probs of the in-process engine; frozen models over external servers fail closed; servers stop with the
engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from k3post.config.rollout import EngineConfig
from k3post.envs.families.registry import get_family
from k3post.models import build_tiny_moe, save_model
from k3post.rollout.teachers import TeacherPool
from k3post.stages.mopd import evaluate_mopd
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.engine import GenerationRequest
from k3post.rollout.factory import build_engine, close_engine
from k3post.serve.launch import LocalServers, ServerHandle
from k3post.xtml import EOM, XTML

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5  # log-prob tolerance across processes (batch composition moves the last bits)
LAUNCH = EngineConfig(kind="http", launch=1, launch_threads=1, backoff_s=0.05)


def _model(tok, seed: int = 0):
    return build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM),
                          initializer_range=0.1)


def test_frozen_model_over_external_servers_fails_closed(xtml_tokenizer):
    """The servers of ``engine.urls`` hold the policy; a frozen model (a teacher, the judge) has no servers
    unless ``engine.launch`` starts some: a ValueError naming it, before any connection is tried."""
    cfg = EngineConfig(kind="http", urls=["http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="the MOPD teacher general.max is a model of its own.*set engine.launch"):
        build_engine(_model(xtml_tokenizer), xtml_tokenizer, engine=cfg, role="MOPD teacher general.max")
    with pytest.raises(ValueError, match=r"engine.launch and engine.launch_threads must be >= 0, got -1 and 0"):
        EngineConfig(kind="http", launch=-1)
    assert EngineConfig(kind="http", launch=2).urls == []  # launched servers need no urls
    with pytest.raises(ValueError, match="launched servers run the default MX QAT scheme only"):
        build_engine(_model(xtml_tokenizer), xtml_tokenizer, engine=LAUNCH, role="judge",
                     qat=QATConfig(weight_format="fp8_e4m3"))
    with pytest.raises(ValueError, match=r"take no \['stop_ids'\]"):
        build_engine(_model(xtml_tokenizer), xtml_tokenizer, engine=LAUNCH, role="judge", stop_ids=[1])


def test_launched_servers_sample_what_the_embedded_engine_samples(xtml_tokenizer):
    """A QAT module handed to `build_engine` over ``http`` + ``launch``: saved to a temporary folder, served
    with the same MX scheme; one request at a time (the same batch composition on both sides), the tokens
    and log-probs equal the embedded engine's. Closing the engine stops the server process and removes the
    folder."""
    tok = xtml_tokenizer
    model = _model(tok, seed=3)
    apply_qat(model, QATConfig())
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    reqs = [GenerationRequest(f"r{i}", [5 + i, 17, 42, 99, 120], sp) for i in range(3)]
    local = EmbeddedEngine(model, tok, max_batch_size=4, seed=11)
    ref = [local.generate([r])[0] for r in reqs]
    eng = build_engine(model, tok, engine=LAUNCH, role="test model", max_batch_size=4, seed=11)
    try:
        servers = eng._close_hooks[0].__self__  # the LocalServers the engine owns
        assert isinstance(servers, LocalServers) and servers.urls == eng.urls and len(servers.servers) == 1
        procs, folder = [s.proc for s in servers.servers], servers.remove_on_close
        assert all(isinstance(p, ServerHandle) for p in procs)  # a worker of this process (k3post.workers)
        assert folder is not None and (folder / "model" / "config.json").is_file()
        got = [eng.generate([r])[0] for r in reqs]
    finally:
        close_engine(eng)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids and len(g.output_ids) == 16
        # (requests decoded together instead would differ now and then by ~5e-3 at a token: batch composition
        # moves an input by 1e-7 and MX fake quantization's FP8 rounding can flip; the demo's gap bound)
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, r.output_logprobs)) < TOL
    assert all(p.poll() is not None for p in procs) and not folder.exists()
    close_engine(eng)  # closing twice is a no-op


def test_a_server_that_cannot_start_names_its_log(tmp_path: Path, xtml_tokenizer):
    """A model folder the server cannot load (no tokenizer): RuntimeError with the server's log tail; no
    process is left running."""
    bad = tmp_path / "bad"
    save_model(_model(xtml_tokenizer), bad, xtml_tokenizer)
    for f in bad.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code \d+ before it was ready.*no tokenizer in the model folder"):
        LocalServers(bad, 1, ready_timeout_s=120)
    with pytest.raises(ValueError, match="not a model folder"):
        LocalServers(tmp_path, 1)


def _launch_in_a_pool_worker(model_dir: str) -> tuple[str, int]:
    """In a daemonic worker (as the experts' pool workers are): start a server, ask its /health, stop it."""
    import httpx

    with LocalServers(model_dir, 1, ready_timeout_s=120, threads=1) as servers:
        s = servers.servers[0]
        return type(s.proc).__name__, httpx.get(s.url + "/health", timeout=10).status_code


def test_a_pool_worker_launches_its_servers_as_fresh_interpreters(tmp_path: Path, xtml_tokenizer):
    """multiprocessing lets a daemonic process (a pool worker: the experts' domain workers) start no process of
    its own, so there a server is a fresh ``python -m k3post serve`` (logged), which serves the same."""
    from k3post.workers import worker_pool

    save_model(_model(xtml_tokenizer), tmp_path / "m", xtml_tokenizer)
    with worker_pool(1) as pool:
        assert pool.apply(_launch_in_a_pool_worker, (str(tmp_path / "m"),)) == ("Popen", 200)


@pytest.mark.slow  # ~35 s: two teachers, a server each
def test_mopd_evaluation_over_launched_teacher_servers_equals_in_process(tmp_path: Path, xtml_tokenizer):
    """`evaluate_mopd` with ``engine`` = http + launch: each teacher is sampled on servers of its own; the
    table equals the in-process evaluation's (greedy episodes: the same tokens)."""
    tok = xtml_tokenizer
    x = XTML(tok)
    folders = {n: save_model(_model(tok, seed=s), tmp_path / n, tok) for n, s in (("t1", 1), ("t2", 2))}
    pool = TeacherPool({"general.low": str(folders["t1"]), "general.max": str(folders["t2"])})
    student = EmbeddedEngine(_model(tok, seed=5), tok)
    tasks = {"general": get_family("general.arithmetic").generate(3, seed=9)}
    kw = dict(efforts=("low", "max"), max_tokens=12, teacher_sees_effort=True)
    try:
        ref = evaluate_mopd(student, x, pool, tasks, **kw)
        got = evaluate_mopd(student, x, pool, tasks, engine=LAUNCH, **kw)
    finally:
        pool.close()
    # (json: NaN ratios, where a teacher passes nothing, compare equal)
    assert json.dumps(got, sort_keys=True) == json.dumps(ref, sort_keys=True) and [r["n"] for r in got["rows"]] == [3, 3]


def test_evaluate_family_over_a_launched_server_equals_in_process(xtml_tokenizer):
    """``eval.engine`` = http + launch: the evaluated model runs on a server of its own (greedy: the same
    completions, so the same pass rate, tokens and examples as the in-process evaluation)."""
    from k3post.config.eval import EvalConfig
    from k3post.recipes.evaluate import evaluate_family

    tok = xtml_tokenizer
    fam = get_family("general.arithmetic")
    tasks = fam.generate(4, seed=2)
    model = _model(tok, seed=7)
    cfg = EvalConfig(max_new_tokens=16, batch_size=4)
    ref = evaluate_family(model, XTML(tok), fam, tasks, effort="max", cfg=cfg)
    got = evaluate_family(model, XTML(tok), fam, tasks, effort="max", cfg=dataclasses.replace(cfg, engine=LAUNCH))
    assert got == ref and ref["n"] == 4 and ref["mean_output_tokens"] > 0


_LAUNCHER = '''
import sys, time
from k3post.serve.launch import LocalServers
if __name__ == "__main__":  # the server is a worker process (k3post.workers), which imports this module again
    servers = LocalServers(sys.argv[1], 1, ready_timeout_s=120)
    print(servers.servers[0].proc.pid, flush=True)
    time.sleep(300)
'''


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_a_launched_server_exits_when_its_command_is_killed(tmp_path: Path, xtml_tokenizer):
    """The command that launched `k3post serve` processes is killed (SIGKILL: no cleanup, no close): its
    servers notice (K3POST_PARENT_PID, `k3post.threads.exit_with_parent`) and exit instead of serving on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    save_model(_model(xtml_tokenizer), tmp_path / "m", xtml_tokenizer)
    (tmp_path / "launch.py").write_text(_LAUNCHER)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "launch.py"), str(tmp_path / "m")], stdout=subprocess.PIPE,
                              text=True)
    server = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), "the server outlived its command"
    finally:
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
