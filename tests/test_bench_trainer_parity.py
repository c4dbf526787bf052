"""bench/trainer_parity.py's ``compare`` (docs/decisions.md, issue 33 §trainer): equal runs are identical, a
one-ulp change of one weight, a changed metric, a dtype or a missing key are found and named. (``run`` trains
five stages for minutes: it is the check itself, run by hand on two checkouts.)

Shape legend: none.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.bench_module import load_bench

parity = load_bench("trainer_parity")


def _result() -> dict:
    w = {"fc.weight": torch.linspace(-1, 1, 12).reshape(3, 4), "d2t": torch.arange(3)}
    return {"sft": {"weights": dict(w), "losses": [2.5, 1.25]},
            "draft": {"weights": dict(w), "rows": [{"step": 1, "loss": 0.5, "alpha_0": float("nan")}]}}


def _compare(tmp_path: Path, a: dict, b: dict, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    rc = parity.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_compare_finds_every_kind_of_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _compare(tmp_path, _result(), _result(), capsys)
    assert rc == 0 and out == {"identical": True, "first_difference": None, "stages": ["draft", "sft"],
                               "weight_tensors": 4}
    ulp = _result()
    t = ulp["draft"]["weights"]["fc.weight"].clone()
    t[1, 2] = torch.nextafter(t[1, 2], torch.tensor(9.0))
    ulp["draft"]["weights"]["fc.weight"] = t
    metric = _result()
    metric["sft"]["losses"][1] += 1e-12
    dtype = _result()
    dtype["sft"]["weights"]["d2t"] = torch.arange(3, dtype=torch.int32)
    missing = copy.deepcopy(_result())
    del missing["draft"]["rows"][0]["alpha_0"]
    for changed, where in ((ulp, ".draft.weights.fc.weight"), (metric, ".sft.losses[1]"), (dtype, ".sft.weights.d2t"),
                           (missing, ".draft.rows[0]: keys ['alpha_0']")):
        rc, out = _compare(tmp_path, _result(), changed, capsys)
        assert rc == 1 and not out["identical"] and out["first_difference"].startswith(where), out
