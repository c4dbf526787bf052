"""SFT, RL, MOPD and serving on a tiny saved checkpoint of every supported family (Llama, Qwen3,
Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3), driven the way a newcomer drives them: `k3post sft`
with ``model.path`` and `k3post rl` with ``rl.init`` pointing at the local folder, `train_mopd` with the
folder as the teacher, and `build_server` over the folder. Each checks that the stage changed or produced
what it should (weights moved, metrics logged, a loadable folder of the same family, a served reply).
Also: SFT's packed loss of a sliding-window model equals separate plain forwards (the window is kept).

Shape legend: none (token lists only).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from k3post.cli import main
from k3post.metrics import read_metrics
from k3post.models import FAMILIES, build_tiny_family, load_model, save_model
from k3post.xtml import XTML
from test_sft import _records, _write

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(xtml_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """family -> a saved tiny checkpoint (model + tokenizer, the tokenizer's vocabulary)."""
    tok = xtml_tokenizer
    root = tmp_path_factory.mktemp("families")
    return {f: save_model(build_tiny_family(f, len(tok), seed=0, pad_token_id=tok.pad_token_id,
                                            eos_token_id=XTML(tok).eom_id), root / f, tok) for f in FAMILIES}


def _params(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(path).named_parameters())


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_cli_on_a_local_checkpoint(checkpoints, family, tmp_path):
    data = _write(tmp_path, _records(6))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run:\n  root: {tmp_path}\n  name: r\nmodel:\n  path: {checkpoints[family]}\n"
                   "sft:\n  steps: 2\n  rows_per_batch: 2\n  log_every: 1\n  progress: false\n")
    assert main(["sft", str(cfg), f"sft.train_file={data}", "sft.lr=1e-3"]) == 0
    final = tmp_path / "r" / "sft" / "final"
    assert load_model(final).config.model_type == load_model(checkpoints[family]).config.model_type
    assert _moved(_params(final), _params(checkpoints[family]))
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl", "sft")
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rl_cli_on_a_local_checkpoint(checkpoints, family, tmp_path):
    args = [f"run.root={tmp_path}", "run.name=r", f"rl.init={checkpoints[family]}", "rl.steps=1", "rl.n_tasks=2",
            "rl.rollout.n_prompts=2", "rl.rollout.k=2", "rl.eval_n=2", "rl.rollout.max_tokens=12", "rl.eval_max_tokens=8",
            "rl.families=[general.arithmetic]", "rl.progress=false", "qat.enabled=false",
            "rl.effort_control.b0_samples=1",
            # the recipe sizes general itself (config.rl.GENERAL_MAX_SETTING): shrunk too
            "rl.domain_overrides.general.n_tasks=2", "rl.domain_overrides.general.eval_n=2", "rl.domain_overrides.general.max.eval_samples=0"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    assert main(["rl", str(cfg), *args]) == 0
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl", "rl/general.max")
    assert [r["step"] for r in rows] == [1]
    final = tmp_path / "r" / "rl" / "general.max" / "final"
    assert load_model(final).config.model_type == load_model(checkpoints[family]).config.model_type


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mopd_on_a_local_checkpoint(checkpoints, xtml_tokenizer, family, tmp_path):
    from k3post.stages.mopd import MOPDConfig, train_mopd
    from k3post.config import PolicyOptimConfig, RLConfig, RolloutConfig

    folder = str(checkpoints[family])
    teacher = build_tiny_family(family, len(xtml_tokenizer), seed=1, initializer_range=0.1)
    save_model(teacher, tmp_path / "teacher", xtml_tokenizer)
    cfg = MOPDConfig(experts={"general.max": str(tmp_path / "teacher")}, effort_mix={"max": 1.0}, domains=["general"],
                     families={"general": ["general.arithmetic"]}, max_resident=1, teacher_sees_effort=False,
                     rl=RLConfig(steps=1, n_tasks=2, save_every=10, progress=False,
                                 rollout=RolloutConfig(n_prompts=2, k=2, max_tokens=12), optim=PolicyOptimConfig(lr=1e-3)))
    student = load_model(folder)
    start = copy.deepcopy(dict(student.named_parameters()))
    res = train_mopd(student, xtml_tokenizer, cfg, tmp_path / "out")
    assert res.steps == 1
    assert _moved(dict(student.named_parameters()), start)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_serve_a_local_checkpoint(checkpoints, family):
    import httpx

    from k3post.serve.cli import build_server

    app = build_server(checkpoints[family], max_batch_size=2, torch_threads=1)
    runner = app.state.server.runner
    assert runner.engine.path == ("general" if family in ("gpt_oss", "deepseek_v3") else "lean")
    runner.start()

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json={"prompt": "Hello there, how are", "max_tokens": 12,
                                                         "seed": 3, "logprobs": 1})

    try:
        resp = asyncio.run(go())
    finally:
        runner.stop()
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    assert resp.json()["usage"]["completion_tokens"] >= 1
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


def test_sft_packed_loss_keeps_the_sliding_window(xtml_tokenizer):
    """gpt-oss has sliding-window layers (window 8): SFT's packed rows must give each sample the loss of
    its own plain forward (which masks by the window), not of a full-attention block-diagonal mask."""
    from k3post.data import Sample, collate
    from k3post.stages.sft import masked_ce_sum

    tok = xtml_tokenizer
    model = build_tiny_family("gpt_oss", len(tok), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(5, len(tok), (n,), generator=g).tolist(), [1] * n, source=str(n)) for n in (30, 21)]
    with torch.no_grad():
        packed = float(masked_ce_sum(model, collate(samples, [[0, 1]], 64, tok.pad_token_id)))
        separate = 0.0
        for s in samples:
            ids_1T = torch.tensor([s.ids])
            logits_TV = model(ids_1T).logits[0]
            separate += float(torch.nn.functional.cross_entropy(logits_TV[:-1], ids_1T[0, 1:], reduction="sum"))
    assert packed == pytest.approx(separate, rel=1e-5)
