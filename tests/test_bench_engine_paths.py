"""bench/engine_paths.py compares like with like: both paths decode the same requests to the same tokens (the
ratio it prints is of the same work), and its tokens/s and KV figures come out of a real run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from k3post.models import build_tiny_moe
from k3post.rollout import GenerationRequest, SamplingParams

_spec = importlib.util.spec_from_file_location("bench_engine_paths", Path(__file__).parents[1] / "bench" / "engine_paths.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_both_paths_sample_the_same_tokens_and_count_decode_tokens_only() -> None:
    model = build_tiny_moe(300, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(f"r{i}", torch.randint(5, 300, (6 + i,), generator=g).tolist(),
                              SamplingParams(max_tokens=5, ignore_eos=True, seed=i)) for i in range(3)]
    out = {path: bench._run(model, reqs, path) for path in ("lean", "general")}
    assert out["lean"][1] == out["general"][1] and all(len(ids) == 5 for ids in out["lean"][1])
    for tps, _, kv_bytes in out.values():
        assert tps > 0 and kv_bytes > 0
