"""The replicated data-parallel trainer (`k3post.trainer.replicated.ReplicatedTrainer`,
``distributed.fsdp.strategy=no_shard``): `k3post sft` on two replica ranks (this process rank 0, rank 1 spawned,
gloo) against the same command on one process, the MTP head included, and a 2-rank run killed after a checkpoint and
resumed on one process.

Tolerances (fp32): each rank runs its share of the step's rows as a micro-batch of its own and the gradients are
summed in one all-reduce, so the step's loss agrees with one process to ~1e-7 relative (a sum over ~1e3 tokens in
another order: 1e-6 bound), the gradient norm to ~1e-6 (1e-5 bound), the weights after a few AdamW steps to ~lr ×
1e-3 absolute, except where a token's top-2 router scores tie to the last bit and its gradient moves between two
experts (expert weights bounded by lr × steps, as tests/test_fsdp_stages.py). The replicas themselves must agree
exactly: the same float operations on the identical summed gradient (`max_drift` = 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3post.cli import main
from k3post.metrics import read_metrics
from k3post.models import load_model
from test_fsdp_stages import init_dir  # noqa: F401 (a fixture: the 2-layer tiny MoE both modules train)
from test_sft import _records, _write

LR, STEPS = 2e-3, 4
SFT_ARGS = ["run.threads=1", f"sft.steps={STEPS}", "sft.rows_per_batch=4", "sft.save_every=2", "sft.log_every=1",
            "sft.progress=false", f"sft.lr={LR}", "sft.warmup_steps=1", "sft.max_len=512", "sft.mtp_weight=0.3",
            "sft.mtp_start_fraction=0.5", "distributed.fsdp.strategy=no_shard"]


def _run(root: Path, name: str, ranks: int, *args: str) -> int:
    cfg = root / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    return main(["sft", str(cfg), f"run.root={root}", f"run.name={name}", f"distributed.fsdp.ranks={ranks}", *args])


class _Killed(Exception):
    pass


@pytest.fixture(scope="module")
def runs(init_dir, tmp_path_factory) -> Path:
    """One process; 2 replica ranks (one micro-batch a step: its rows split over the ranks); 2 ranks killed right
    after the step-2 checkpoint, resumed on one process."""
    root = tmp_path_factory.mktemp("replicated")
    data = _write(root, _records(40))
    args = [f"model.path={init_dir}", f"sft.train_file={data}", *SFT_ARGS]
    assert _run(root, "one", 1, *args) == 0
    assert _run(root, "two", 2, *args) == 0
    import k3post.checkpoint as ck

    real = ck.save_checkpoint

    def save_then_die(path, step, *a, **kw):  # noqa: ANN001, ANN202
        out = real(path, step, *a, **kw)
        if step == 2:
            raise _Killed
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "save_checkpoint", save_then_die)
        assert _run(root, "resumed", 2, *args) == 1
    assert _run(root, "resumed", 1, *args) == 0
    return root


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_model(folder).state_dict()


def _check_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        bound = LR * STEPS if ".experts." in k else 1e-5  # a last-bit router tie moves a token between experts
        assert float((a[k].float() - b[k].float()).abs().max()) <= bound, k


def test_sft_on_two_replica_ranks_equals_one_process_mtp_head_included(runs):
    one = read_metrics(runs / "one" / "metrics.jsonl", "sft")
    two = read_metrics(runs / "two" / "metrics.jsonl", "sft")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert a["target_tokens"] == b["target_tokens"]
        assert abs(a["step_loss"] - b["step_loss"]) <= 1e-6 * a["step_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
        assert ("mtp_loss" in a) == ("mtp_loss" in b) == (a["step"] > STEPS // 2)
        if "mtp_loss" in a:  # the MTP head trained on both ranks' rows
            assert abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-6 * a["mtp_loss"], (a, b)
    # single-process checkpoints (no dcp/), with the MTP head beside the model
    ckpt = runs / "two" / "sft" / "checkpoints" / "step-000004"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "mtp.safetensors").is_file() and not (ckpt / "dcp").exists()
    _check_close(_weights(runs / "one" / "sft" / "final"), _weights(runs / "two" / "sft" / "final"))
    from safetensors.torch import load_file

    m1, m2 = load_file(runs / "one" / "sft" / "final" / "mtp.safetensors"), load_file(runs / "two" / "sft" / "final" / "mtp.safetensors")
    # AdamW's first steps move an entry by ~lr whatever its gradient's size: after its two steps an entry whose
    # gradient sits at the noise level may differ by up to ~2 lr (measured 6e-5); its losses above agree to 1e-6
    assert max(float((m1[k] - m2[k]).abs().max()) for k in m1) <= 2 * LR
    assert max(float((m1[k] - load_file(ckpt.parent / "step-000002" / "mtp.safetensors")[k]).abs().max()) for k in m1) > 0


def test_replica_checkpoint_resumes_on_one_process(runs):
    two = read_metrics(runs / "two" / "metrics.jsonl", "sft")
    resumed = read_metrics(runs / "resumed" / "metrics.jsonl", "sft")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(two, resumed):
        assert abs(a["step_loss"] - b["step_loss"]) <= 1e-6 * a["step_loss"], (a, b)
    _check_close(_weights(runs / "two" / "sft" / "final"), _weights(runs / "resumed" / "sft" / "final"))


def _replica_worker(rank: int, out: str) -> None:
    """Rank r of 2: a tiny model (rank 1 starts from other weights: the first step broadcasts rank 0's), four
    steps of a toy loss on rank-dependent batches, then the drift and rank 0's weights to ``out``."""
    from k3post.config.optim import OptimConfig
    from k3post.trainer.replicated import ReplicatedTrainer

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    unused = torch.nn.Linear(2, 2)  # never in a loss: it keeps no gradient, AdamW skips it
    model.add_module("unused", unused)
    trainer = ReplicatedTrainer(model, OptimConfig(lr=0.05), grad_clip=0.5, lead=(lambda c: None) if rank == 0 else None)
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + i)) for i in range(3)]
    before = unused.weight.detach().clone()
    trainer.sync()  # what rank 0's first step leads: rank 1's other weights become rank 0's
    for _ in range(4):
        trainer.step(batches, _toy_grads)
    drift = trainer.max_drift()
    if rank == 0:
        torch.save({"drift": drift, "weights": {k: v.clone() for k, v in model.state_dict().items()},
                    "unused_moved": float((unused.weight - before).abs().max())}, out)


def _toy_grads(model, micro_batches, *, version=None, before_backward=None):  # noqa: ANN001, ANN202
    total = 0.0
    for x in micro_batches:
        loss = model[2](model[1](model[0](x))).pow(2).sum() / 12.0  # the step's 3 × 4 rows: a mean over all ranks
        loss.backward()
        total += float(loss)
    return {"loss": total}


def test_replicas_stay_equal_and_match_one_process(tmp_path):
    """Two replica ranks (items 0, 2 on rank 0, item 1 on rank 1): after four clipped AdamW steps the replicas
    agree bit for bit, the weights equal one process's stepping all three items to 1e-6, and a parameter that no
    rank gave a gradient did not move (AdamW skipped it, as in one process)."""
    from k3post.config.optim import OptimConfig
    from k3post.trainer.fsdp import launch_local
    from k3post.trainer.local import Trainer

    out = tmp_path / "rank0.pt"
    launch_local(_replica_worker, 2, str(out))
    got = torch.load(out)
    assert got["drift"] == 0.0 and got["unused_moved"] == 0.0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model.add_module("unused", torch.nn.Linear(2, 2))
    trainer = Trainer(model, OptimConfig(lr=0.05), grad_clip=0.5)
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + i)) for i in range(3)]
    for _ in range(4):
        trainer.step(batches, _toy_grads)
    for k, v in model.state_dict().items():
        assert torch.allclose(v, got["weights"][k], atol=1e-6, rtol=0), k


@pytest.mark.parametrize("override, message", [
    (["distributed.fsdp.strategy=ddp"], r"distributed.fsdp.strategy must be one of \('full_shard', 'no_shard'\)"),
    (["distributed.fsdp.strategy=no_shard", "distributed.fsdp.mixed_precision=bf16"], "full_shard settings"),
])
def test_bad_strategy_fails_at_load(override, message):
    from k3post.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, override)


def test_mtp_head_on_sharded_ranks_is_refused_with_the_setting_that_allows_it(tmp_path, init_dir):
    """FSDP shards no extra module: `k3post sft` with the MTP head on 2 full_shard ranks stops before anything runs
    (exit 2) and names strategy=no_shard."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    code = main(["sft", str(cfg), f"run.root={tmp_path}", "distributed.fsdp.ranks=2", "sft.mtp_weight=0.3",
                 f"model.path={init_dir}"])
    assert code == 2 and not (tmp_path / "r" / "sft").exists()
