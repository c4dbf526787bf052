"""The systems seams: `build_engine` is the only place engines are built, `Rollout` owns the rollout side
and `Trainer` the model, optimizer and device; configs fail with the key named."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from k3post.config import ConfigError, load_config
from k3post.models import build_tiny_moe
from k3post.policy_step import TokenSequence, policy_step, train_policy_step
from k3post.config.rollout import EngineConfig
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.factory import Rollout, RolloutConfig, build_engine
from k3post.trainer import OptimConfig, Trainer, build_optimizer, resolve_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             moe_intermediate_size=32, num_experts=4, intermediate_size=64)
_PKG = Path(__file__).resolve().parents[1] / "k3post"


def test_engines_are_built_only_by_the_factory():
    """No module but k3post/rollout/factory.py constructs an engine (the seam a distributed mode fills)."""
    ctor = re.compile(r"\b(EmbeddedEngine|VLLMEngine|SGLangEngine|HTTPEngine)\(")
    where = []
    for path in sorted(_PKG.rglob("*.py")):
        rel = path.relative_to(_PKG).as_posix()
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if ctor.search(code) and not re.match(r"\s*(class |def |\"|')", code) and "`" not in code:
                where.append(f"{rel}:{no}: {line.strip()}")
    assert [w for w in where if not w.startswith("rollout/factory.py")] == []


def test_engine_config_names_the_bad_key():
    with pytest.raises(ValueError, match=r"engine.kind must be one of \('embedded', 'http'\), got 'grpc'"):
        EngineConfig(kind="grpc")
    with pytest.raises(ValueError, match="engine.kind is http: list the servers in engine.urls"):
        EngineConfig(kind="http")
    with pytest.raises(ValueError, match=r"engine.urls: not http\(s\) URLs: \['localhost:30000'\]"):
        EngineConfig(kind="http", urls=["localhost:30000"])
    with pytest.raises(ValueError, match="engine.kind must be one of"):
        load_config(overrides=["rl.rollout.engine.kind=grpc"])
    with pytest.raises(ConfigError, match="rl.rollout.engine.kindd"):
        load_config(overrides=["rl.rollout.engine.kindd=http"])
    assert load_config(overrides=["rl.rollout.engine.kind=http", "rl.rollout.engine.urls=[http://127.0.0.1:1]"]).rl.rollout.engine.urls == [
        "http://127.0.0.1:1"]
    with pytest.raises(ValueError, match=r"engine.max_concurrency must be >= 0 \(0: the whole workload\), got -1"):
        EngineConfig(max_concurrency=-1)


def test_build_engine_embedded_shares_the_models_tensors():
    model = build_tiny_moe(64, seed=0, **_TINY)
    eng = build_engine(model, None, max_batch_size=3, max_model_len=64, seed=5)
    assert isinstance(eng, EmbeddedEngine) and eng.model is model and eng.shares_weights
    assert (eng.max_batch_size, eng.max_model_len) == (3, 64)


def test_resolve_device_fails_closed():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' asked for, but torch sees no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device 'tpu9'"):
        resolve_device("tpu9")


def test_optim_config():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert isinstance(build_optimizer(p, OptimConfig()), torch.optim.AdamW)
    sgd = build_optimizer(p, OptimConfig(name="sgd", lr=0.5, momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="optimizer name must be one of"):
        OptimConfig(name="lion")
    with pytest.raises(ValueError, match="betas"):
        OptimConfig(betas=[0.9])


def _seqs(vocab: int) -> list[TokenSequence]:
    g = torch.Generator().manual_seed(1)
    out = []
    for j, n in enumerate([7, 5, 9]):
        ids = torch.randint(3, vocab, (12 + n,), generator=g).tolist()
        out.append(TokenSequence(ids, [False] * 12 + [True] * n, [-2.0] * (12 + n), [0.0] * 12 + [1.0 - j] * n,
                                 [-1] * 12 + [0] * n))
    return out


def test_trainer_step_is_policy_step_on_its_device():
    """The trainer's step with the policy gradient function equals `policy_step` with the same optimizer
    settings (bitwise on one thread), leaves the model in eval mode, and `named_weights` are the live
    parameters by name."""
    model = build_tiny_moe(64, seed=0, **_TINY)
    ref = copy.deepcopy(model)
    tr = Trainer(model, OptimConfig(lr=1e-2), device="cpu", grad_clip=1.0)
    m1 = train_policy_step(tr, _seqs(64), pad_id=0, micro_batch_tokens=64, version=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    m2 = policy_step(ref, opt, _seqs(64), pad_id=0, micro_batch_tokens=64, grad_clip=1.0, version=0)
    assert m1 == m2 and not model.training
    named = tr.named_weights()
    assert [n for n, _ in named][: len(list(ref.parameters()))] == [n for n, _ in ref.named_parameters()]
    for (n1, t1), (n2, t2) in zip(named, ref.named_parameters()):
        assert torch.equal(t1, t2)
    assert named[0][1].data_ptr() == next(model.parameters()).data_ptr()
    state = tr.state_dict()
    tr2 = Trainer(copy.deepcopy(ref), OptimConfig(lr=1e-2))
    tr2.load_state_dict(state)
    assert tr2.optimizer.state_dict()["state"][0]["step"] == 1


def test_rollout_push_weights_and_state(xtml_tokenizer):
    """An embedded rollout's push is a version bump (the engine reads the trainer's tensors); its state
    round-trips the engine version into a fresh rollout."""
    tok = xtml_tokenizer
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, **_TINY)
    cfg = RolloutConfig(n_prompts=2, k=2, max_tokens=8, max_model_len=256, slots=4)
    r = Rollout(model, tok, cfg)
    try:
        assert r.version == 0 and r.push_weights() == 1 and r.push_weights(version=5) == 5
        assert r.scheduler.max_concurrency == 4  # engine.max_concurrency 0: the workload, N·K
        state = r.state_dict()
    finally:
        r.close()
    r2 = Rollout(model, tok, cfg)
    try:
        r2.load_state_dict(state)
        assert r2.version == 5
    finally:
        r2.close()
    r3 = Rollout(model, tok, dataclasses.replace(cfg, engine=EngineConfig(max_concurrency=1)))
    try:
        assert (r3.scheduler.max_concurrency, r3.scheduler.concurrency) == (1, 1)
    finally:
        r3.close()
