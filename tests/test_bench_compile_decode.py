"""bench/compile_decode.py: its layer stack is the engine's decode step (bit for bit, with and without QAT, rows at
different positions), and a compiled run prints the keys its last line promises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from k3post.models import build_tiny_moe
from k3post.quant.qat import QATConfig, apply_qat

_spec = importlib.util.spec_from_file_location("bench_compile_decode", Path(__file__).parents[1] / "bench" / "compile_decode.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("qat", [False, True])
def test_the_stack_is_the_engines_decode_step(qat):
    model = build_tiny_moe(300, "tiny", seed=0).eval()
    if qat:
        apply_qat(model, QATConfig(enabled=True))
    engine = bench.decoding_engine(model, 3, 8, steps=4)
    lf = engine._lean
    pos = [11, 9, 11]  # ragged: row 1 attends to fewer positions (the mask does the work the engine's segments do)
    L = max(pos) + 1
    ids = [7, 8, 9]
    pos_B = torch.tensor(pos)
    with torch.inference_mode():
        w = lf.weights()
        got = bench.decode_stack(lf, w, torch.tensor(ids), pos_B, lf.decode_mask(w, pos_B, L), 3, L)
        want = lf.decode(ids, pos)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_a_compiled_run_reports_its_keys(capsys):
    out = bench.main(["--batches", "1", "--no-qat", "--calls", "2", "--repeats", "1", "--context", "16"])
    # a machine whose inductor cannot compile (no C++ compiler) reports why instead of a speed-up
    assert ("speedup_b1_noqat" in out and out["stack_vs_decode_b1_noqat"] == 0.0
            and out["max_abs_diff_b1_noqat"] < 1e-4) or "error_b1_noqat" in out
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
