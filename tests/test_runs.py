"""Run folders and checkpoints a user (or an attacker) can break (issue 30 §4, §5): incomplete checkpoints are
an error or a loud fallback, never a silent restart; one command at a time per run folder; a changed config is
refused on resume; input errors exit 2 before anything is written; trainer_state.pt and DCP metadata load
without running code.

Shape legend: none (whole models only).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from k3post import checkpoint as ck
from k3post.checkpoint import BrokenCheckpointError, latest_checkpoint, load_trainer_state, save_checkpoint
from k3post.errors import UserError


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _Payload:
    """Unpickling this runs ``open(marker, "w")`` (what a planted checkpoint would do with os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


# --------------------------------------------------------------------------- §5: loads run no code


def test_a_planted_trainer_state_runs_no_code(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, None, None, {"x": 1})
    ckpt = latest_checkpoint(root)
    assert load_trainer_state(ckpt)["x"] == 1  # tensors and plain data load with weights_only=True
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(marker)}, ckpt / "trainer_state.pt")
    with pytest.raises(UserError, match="trainer_state.pt: refused: it holds objects other than tensors"):
        load_trainer_state(ckpt)
    assert not marker.exists()


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    root = tmp_path / "ckpt"
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.normal()  # a cached Gaussian is part of numpy's state
    save_checkpoint(root, 1, None, None, {})
    want = (torch.rand(3), random.random(), np.random.normal(), np.random.rand(3))
    ck.set_rng_state(load_trainer_state(latest_checkpoint(root))["rng"])
    got = (torch.rand(3), random.random(), np.random.normal(), np.random.rand(3))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and want[2] == got[2] and (want[3] == got[3]).all()


def test_an_older_checkpoints_numpy_rng_state_still_loads(tmp_path):
    """Checkpoints written before issue 30 pickled numpy's RNG state as an ndarray: allowed by name."""
    import numpy as np

    folder = tmp_path / "step-000001"
    folder.mkdir()
    torch.save({"step": 1, "rng": {"torch": torch.get_rng_state(), "python": __import__("random").getstate(),
                                   "numpy": np.random.get_state()}}, folder / "trainer_state.pt")
    state = load_trainer_state(folder)
    ck.set_rng_state(state["rng"])
    assert state["step"] == 1


def _dcp_checkpoint(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=folder)
    return m, opt


def test_dcp_loads_through_the_allow_list_and_a_planted_metadata_runs_no_code(tmp_path):
    import warnings

    folder = tmp_path / "dcp"
    m, opt = _dcp_checkpoint(folder)
    m2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.load_dcp(m2, opt2, folder)
    assert torch.equal(m2.weight, m.weight) and opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt2.state[m2.weight]["exp_avg"], opt.state[m.weight]["exp_avg"])
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UserError, match=r"\.metadata: refused: not a DCP metadata file \(io.open is not allowed"):
        ck.load_dcp(m2, opt2, folder)
    assert not marker.exists()


def test_dcp_non_tensor_values_load_weights_only(tmp_path):
    """DCP keeps non-tensor values (the optimizer's hyperparameters) as torch.save bytes: a planted one is refused."""
    planner = ck._safe_dcp_planner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = type("R", (), {"dest_index": type("I", (), {"fqn": "x"})()})()
    buf = io.BytesIO()
    torch.save(0.5, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
    assert planner.state_dict["x"] == 0.5
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)
    assert not marker.exists()


# --------------------------------------------------------------------------- §4: incomplete checkpoints


def _three(root: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(root, step, None, None, {"x": step}, keep_last=3)


def test_a_checkpoint_lists_its_files_and_sizes(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, None, None, {"x": 1}, write_extra=lambda f: (f / "extra.bin").write_bytes(b"abc"))
    import json

    files = json.loads((root / "step-000001" / "manifest.json").read_text())["files"]
    assert files["extra.bin"] == 3 and files["trainer_state.pt"] > 0
    assert ck.checkpoint_problem(root / "step-000001") is None
    (root / "step-000001" / "extra.bin").write_bytes(b"a")
    assert ck.checkpoint_problem(root / "step-000001") == "extra.bin has 1 bytes, manifest.json says 3"


@pytest.mark.parametrize("damage", ["trainer_state", "manifest_file", "latest_and_newest"])
def test_an_incomplete_newest_checkpoint_is_an_error_naming_it_and_the_newest_intact(tmp_path, damage):
    """`latest` naming a checkpoint without trainer_state.pt (or with a file the manifest lists missing), or no
    `latest` and an incomplete newest step: BrokenCheckpointError naming both; nothing on disk changes (no
    rotation, no cleanup)."""
    root = tmp_path / "ckpt"
    _three(root)
    if damage == "trainer_state":
        (root / "step-000003" / "trainer_state.pt").unlink()
    elif damage == "manifest_file":
        (root / "step-000003" / "manifest.json").write_text('{"step": 3, "files": {"model.safetensors": 10}}')
    else:
        (root / "latest").unlink()
        (root / "step-000003" / "trainer_state.pt").unlink()
    before = _snapshot(root)
    with pytest.raises(BrokenCheckpointError) as ei:
        latest_checkpoint(root, keep_last=1)
    msg = str(ei.value)
    assert str(root / "step-000003") in msg and f"the newest intact checkpoint is {root / 'step-000002'}" in msg
    assert "run.on_broken_checkpoint=fallback" in msg and "run.restart=true" in msg
    assert _snapshot(root) == before


def test_fall_back_moves_the_broken_ones_aside_and_resumes_from_the_newest_intact(tmp_path):
    root = tmp_path / "ckpt"
    _three(root)
    (root / "step-000003" / "trainer_state.pt").unlink()
    (root / "step-000002" / "trainer_state.pt").unlink()
    assert ck.fall_back(root) == root / "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["broken-step-000002", "broken-step-000003", "latest", "step-000001"]
    assert latest_checkpoint(root).name == "step-000001"
    (root / "step-000001" / "trainer_state.pt").unlink()
    with pytest.raises(BrokenCheckpointError, match="no intact checkpoint to fall back to"):
        ck.fall_back(root)


def test_a_missing_latest_with_a_complete_newest_checkpoint_resumes_from_it(tmp_path):
    """A kill between the rename of the first checkpoint and the write of `latest` leaves exactly this: the
    newest step folder is complete (its manifest says so), so it is what the folder says."""
    root = tmp_path / "ckpt"
    _three(root)
    (root / "latest").unlink()
    assert latest_checkpoint(root).name == "step-000003"
    (root / "step-000003" / "manifest.json").unlink()  # an older k3post's checkpoint: completeness unknown
    with pytest.raises(BrokenCheckpointError, match="its manifest is missing"):
        latest_checkpoint(root)
