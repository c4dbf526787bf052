"""The engine server against a hostile or careless client (issue 30, section 5).

* A weight update is all or nothing: a checkpoint that lacks some of the served model's tensors (a Qwen3
  checkpoint without ``q_norm`` / ``k_norm``), or has a tensor of another dtype kind, is a 400 naming what
  differs, and the weights and version stay.
* What an unauthenticated caller can reach is bounded and documented: ``/get_weights_by_name`` reads at most
  ``ServeLimits.max_weight_values`` values, ``/get_model_info`` shows folder names, not paths, ``k3post serve``
  on a non-loopback host needs a key or ``--allow-unauthenticated-engine-api`` (exit 2 otherwise), and the
  README's Security section lists every route with its risk.
* One client cannot stall the others: tokenising runs off the event loop (``/health`` answers while a prompt
  is being tokenised), prompts are bounded (``ServeLimits.max_prompt_chars``).
* Bad bodies get 4xx answers: a deeply nested JSON body is a 400 (``ServeLimits.max_json_depth``), ``/generate``
  over ``ServeLimits.max_tokens`` is a 400, and an oversized body is read and discarded (up to
  ``ServeLimits.max_drain_bytes``) so the client sees the 413 instead of a connection reset.

Servers run in process through httpx's ASGI transport, except the body-size case, which needs a real socket
(uvicorn on a free loopback port).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from safetensors.torch import load_file, save_file  # noqa: E402

from k3post.models import build_tiny_family, save_model  # noqa: E402
from k3post.serve.app import ServeLimits  # noqa: E402
from k3post.serve.cli import build_server  # noqa: E402
from k3post.xtml import XTML  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _qwen3(tok: Any, seed: int) -> Any:
    return build_tiny_family("qwen3", len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=XTML(tok).eom_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, xtml_tokenizer: Any) -> Path:
    return save_model(_qwen3(xtml_tokenizer, 0), tmp_path_factory.mktemp("sec") / "qwen3", xtml_tokenizer)


def _run(model_dir: Path, go: Callable[[httpx.AsyncClient, Any], Awaitable[Any]], **kw: Any) -> Any:
    app = build_server(model_dir, model_name="m", max_batch_size=2, qat=False, torch_threads=1, **kw)
    runner = app.state.server.runner
    runner.start()

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await go(c, app)

    try:
        return asyncio.run(main())
    finally:
        runner.stop()


async def _weights(c: httpx.AsyncClient, name: str) -> list[float]:
    r = await c.post("/get_weights_by_name", json={"name": name, "truncate_size": 8})
    assert r.status_code == 200, r.text
    return r.json()["values"]


# --------------------------------------------------------------------------- all-or-nothing weight updates


def test_a_partial_or_mistyped_weight_update_is_refused_and_changes_nothing(model_dir: Path, xtml_tokenizer: Any,
                                                                          tmp_path: Path) -> None:
    """Before: a Qwen3 checkpoint without q_norm / k_norm answered 200 and the server served the new layers with
    the old norms. Now: 400 naming the missing tensors, the same for a tensor subset by name and for an integer
    tensor in place of a float one; a DiskSync version missing a tensor too. The full checkpoint loads, and a
    bf16 copy of it is cast to the model's fp32 (a float-to-float cast is allowed, documented)."""
    from k3post.distributed.weight_sync import DiskSync, named_weights

    other = _qwen3(xtml_tokenizer, 1)
    with torch.no_grad():  # norms other than the served model's ones, so a lost q_norm shows
        for n, p in other.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(n)))
    full = save_model(other, tmp_path / "full", xtml_tokenizer)
    [shard] = sorted(full.glob("*.safetensors"))
    tensors = load_file(str(shard))
    assert any("q_norm" in n for n in tensors)

    def folder(name: str, content: dict[str, torch.Tensor], *, hf: bool) -> str:
        d = tmp_path / name
        d.mkdir()
        if hf:  # a Hugging Face checkpoint folder: config.json next to the shard
            (d / "config.json").write_text((full / "config.json").read_text())
        save_file(content, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    no_norms = {n: t for n, t in tensors.items() if "q_norm" not in n and "k_norm" not in n}
    first = sorted(tensors)[0]
    cases = [
        (folder("no_norms", no_norms, hf=True), "k_norm"),
        (folder("subset", {first: tensors[first]}, hf=False), "missing"),
        (folder("int", {**tensors, first: tensors[first].to(torch.int32)}, hf=False), "dtype int32"),
    ]
    sync = DiskSync(tmp_path / "sync").push([(n, t) for n, t in named_weights(other) if "q_norm" not in n], 5)
    cases.append((sync.location, "q_norm"))

    async def go(c: httpx.AsyncClient, app: Any) -> None:
        before = await _weights(c, "model.layers.0.self_attn.q_norm.weight")
        embed = await _weights(c, "model.embed_tokens.weight")
        for path, needle in cases:
            r = await c.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status_code == 400, (path, r.text)
            body = r.json()
            assert not body["success"] and needle in body["message"] and body["weight_version"] == 0, (path, body)
            assert await _weights(c, "model.embed_tokens.weight") == embed
        assert (await c.get("/get_weight_version")).json() == {"weight_version": 0}
        r = await c.post("/update_weights_from_disk", json={"model_path": str(full)})
        assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
        after = await _weights(c, "model.layers.0.self_attn.q_norm.weight")
        want = other.model.layers[0].self_attn.q_norm.weight.detach().reshape(-1)[:8].tolist()
        assert after == want and after != before
        half = folder("bf16", {n: t.to(torch.bfloat16) for n, t in tensors.items()}, hf=False)
        r = await c.post("/update_weights_from_disk", json={"model_path": half})
        assert r.status_code == 200 and r.json()["weight_version"] == 2, r.text
        d = (await c.post("/get_weights_by_name", json={"name": first, "truncate_size": 8})).json()
        assert d["dtype"] == "float32"
        assert d["values"] == tensors[first].to(torch.bfloat16).float().reshape(-1)[:8].tolist()

    _run(model_dir, go)
