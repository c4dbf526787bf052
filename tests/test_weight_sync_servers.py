"""Weight sync into engine servers over ``torch.distributed`` (issue 15, "Weight sync"): an `HTTPEngine`
with ``weight_sync="distributed"`` (the trainer, rank 0 of a gloo group) and two ``k3post serve``
processes with MX QAT on (ranks 1 and 2, joined through ``/init_weights_update_group``; every sync is
``/update_weights_from_distributed`` on both servers while the trainer broadcasts).

The trainer is the served tiny Qwen3-MoE with QAT applied and its weights perturbed (a new seeded
perturbation per sync). After each sync both servers report the new ``/get_weight_version``, hold
the trainer's tensors bit for bit (``/get_weights_by_name``), and their greedy and sampled
``/generate`` outputs (tokens and log-probs) equal an in-process `EmbeddedEngine` over a copy of
the trainer's model exactly. A sync with a wrong-shape tensor is rejected by both servers' manifest
vote: both stay on the old version, weights and outputs; the next good sync repairs them. SGLang's
posted ``shapes`` that disagree with the broadcast manifest are voted down the same way.

Shape legend: none (token lists; weights by name).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_http_engine import Server, _generate, _lp, model_dir, running_servers  # noqa: F401 - model_dir: fixture

from k3post.config.rollout import EngineConfig
from k3post.distributed.weight_sync import MB, WeightSyncError, named_weights
from k3post.models import load_model
from k3post.quant.qat import QATConfig, apply_qat
from k3post.rollout import EmbeddedEngine, SamplingParams
from k3post.rollout.engine import GenerationRequest
from k3post.rollout.factory import build_engine
from k3post.rollout.http_engine import HTTPEngine

pytest.importorskip("uvicorn")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 42, 99, 120, 7, 64]
CASES = [SamplingParams(max_tokens=12, seed=1, temperature=0.0, ignore_eos=True),  # greedy
         SamplingParams(max_tokens=12, seed=2, temperature=0.8, top_k=20, ignore_eos=True)]
CHECKED = ("model.embed_tokens.weight", "model.layers.0.mlp.experts.gate_up_proj", "model.norm.weight")


@pytest.fixture(scope="module")
def qat_servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    with running_servers(model_dir, tmp_path_factory.mktemp("logs"), "AB", qat=True) as out:
        yield list(out.values())


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _outputs(s: Server) -> list[tuple[list[int], list[float]]]:
    out = []
    for sp in CASES:
        d = _generate(s, PROMPT, sp)
        out.append((d["output_ids"], _lp(d)))
    return out


def _reference(trainer: torch.nn.Module, tok: Any) -> list[tuple[list[int], list[float]]]:
    ref = EmbeddedEngine(copy.deepcopy(trainer), tok, qat=QATConfig(), max_batch_size=4, seed=0)
    out = []
    for i, sp in enumerate(CASES):
        [r] = ref.generate([GenerationRequest(f"r{i}", PROMPT, sp)])
        out.append((r.output_ids, r.output_logprobs))
    return out


def _check_servers(servers: list[Server], trainer: torch.nn.Module, tok: Any, version: int) -> list[Any]:
    """Both servers at ``version`` with the trainer's tensors and the reference outputs, bit for bit."""
    ref = _reference(trainer, tok)
    weights = dict(named_weights(trainer))
    for s in servers:
        assert s.get("/get_weight_version") == {"weight_version": version}
        for name in CHECKED:
            t = weights[name]
            d = s.post("/get_weights_by_name", {"name": name, "truncate_size": 4096}).json()
            assert d["shape"] == list(t.shape) and d["dtype"] == "float32"
            assert torch.equal(torch.tensor(d["values"], dtype=torch.float32), t.reshape(-1)[:4096]), (s.url, name)
        got = _outputs(s)
        assert got == ref, (s.url, version)
        assert got[0][0] != got[1][0] or got[0][1] != got[1][1]  # greedy and sampled differ: two real checks
    return ref


def test_distributed_sync_into_two_qat_servers(qat_servers: list[Server], model_dir: Path, xtml_tokenizer: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    tok = xtml_tokenizer
    trainer = load_model(model_dir)
    apply_qat(trainer, QATConfig())
    base = _check_servers(qat_servers, trainer, tok, 0)  # version 0: the served folder's weights
    engine = HTTPEngine([s.url for s in qat_servers], weight_sync="distributed", shard_mb=0.5, sync_timeout_s=60)
    stats = []
    try:
        outputs = [base]
        for version in (1, 2):
            _perturb(trainer, seed=version)
            assert engine.update_weights(named_weights(trainer), version=version) == version
            stats.append(engine.last_sync_stats)
            outputs.append(_check_servers(qat_servers, trainer, tok, version))
            assert outputs[-1] != outputs[-2]  # the sync changed what the servers sample
        assert stats[0].buckets > 1 and stats[0].version == 1 and stats[1].version == 2

        # a wrong-shape tensor: both servers vote against the manifest, nothing is applied anywhere
        good = copy.deepcopy(trainer)
        _perturb(trainer, seed=3)
        bad = [(n, t[:-1] if n == "model.embed_tokens.weight" else t) for n, t in named_weights(trainer)]
        with pytest.raises(WeightSyncError) as err:
            engine.update_weights(bad, version=3)
        msg = str(err.value)
        assert all(s.url in msg for s in qat_servers) and "model.embed_tokens.weight" in msg and "keeps version 2" in msg
        assert engine.version == 2
        assert _check_servers(qat_servers, good, tok, 2) == outputs[-1]  # old version, weights and outputs

        # the next good sync (same group) repairs them
        t0 = time.perf_counter()
        assert engine.update_weights(named_weights(trainer), version=3) == 3
        wall = time.perf_counter() - t0
        stats.append(engine.last_sync_stats)
        _check_servers(qat_servers, trainer, tok, 3)
        group = engine._sync_group
        assert group is not None

        # SGLang's posted shapes disagree with the broadcast manifest: both servers vote it down
        named = named_weights(trainer)
        body = {"names": [n for n, _ in named], "shapes": [[1]] * len(named), "group_name": group, "weight_version": 4}
        answers: list[Any] = []
        posts = [threading.Thread(target=lambda s=s: answers.append(s.post("/update_weights_from_distributed", body)))
                 for s in qat_servers]
        for t in posts:
            t.start()
        with pytest.raises(WeightSyncError, match="posted 'shapes' differ from the broadcast manifest at entry 0"):
            engine._sync.push(named, 4)
        for t in posts:
            t.join(60)
        assert [r.status_code for r in answers] == [400, 400]
        assert all(s.get("/get_weight_version") == {"weight_version": 3} for s in qat_servers)
    finally:
        engine.close()
    for s in qat_servers:  # close() left the group on both servers
        r = s.post("/update_weights_from_distributed", {"group_name": group, "weight_version": 4})
        assert r.status_code == 400 and "no weight-sync group" in r.json()["message"]
    with capsys.disabled():
        for st in stats:
            print(f"\ndistributed sync v{st.version}: {st.bytes / MB:.2f} MB in {st.buckets} buckets, {st.seconds:.3f} s, "
                  f"{st.mb_per_s:.1f} MB/s (gloo, loopback, 2 servers)", end="")
        print(f"\nlast sync with its HTTP round trips: {wall:.3f} s")


def test_endpoint_errors_and_factory_passes_weight_sync(qat_servers: list[Server]) -> None:
    s = qat_servers[0]
    r = s.post("/update_weights_from_distributed", {"group_name": "nope", "names": [], "weight_version": 9})
    assert r.status_code == 400 and "no weight-sync group 'nope'" in r.json()["message"]
    r = s.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                              "world_size": 2, "group_name": "g", "backend": "gloo"})
    assert r.status_code == 400 and "rank_offset" in r.json()["message"]
    r = s.post("/get_weights_by_name", {"name": "no.such.weight"})
    assert r.status_code == 400 and "no.such.weight" in r.text
    cfg = EngineConfig(kind="http", urls=[x.url for x in qat_servers], weight_sync="distributed", bucket_mb=8, timeout_s=30)
    engine = build_engine("unused", engine=cfg)
    try:
        assert isinstance(engine, HTTPEngine) and engine.weight_sync == "distributed" and engine.shard_mb == 8
        assert engine.sync_timeout_s == 30
    finally:
        engine.close()
