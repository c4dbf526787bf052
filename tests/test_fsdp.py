"""The sharded trainer (k3post/trainer/fsdp.py): 2 gloo ranks on the CPU against the single-process
`Trainer` on the same data and seed; a 2-rank DCP checkpoint resumed on 1 rank; the consolidated export.

One 2-rank job (a module fixture, ~10 s) runs every sharded step the tests compare:
    RL   QAT on, SGD: 2 `step`s with the policy gradient function (`train_policy_step`), then `named_weights`
    SFT  AdamW, no clipping: 2 `step`s with the SFT gradient function (`sft_step`), DCP checkpoint, a 3rd step,
         `named_weights`, `export_hf`
    bf16 one `sft_step` under MixedPrecisionPolicy(bf16 params, fp32 reduce)
The single-process reference runs in the test process.

Tolerances (fp32). Per micro-batch, a rank runs the same computation as one process (same weights, shapes,
kernels and one torch thread: `launch_local` pins the ranks to one, the SFT reference runs with one, `ranks_threads`).
Two things differ, each by rounding only (~1e-7 relative):
  (a) the reduction order of the micro-batch gradients: rank r runs micro-batches r, r + 2, ... and the ranks'
      sums are added, (g0 + g2) + g1, where one process accumulates (g0 + g1) + g2;
  (b) the clip coefficient grad_clip / ‖g‖: the global norm is summed shard by shard over the ranks.
SGD (the RL steps, lr 0.5 × 2 steps) passes them on linearly: |Δw| ≈ lr · Σ_steps |Δ(c·g)| with |Δ(c·g)| ≲ (2u + δc)·|c·g|,
u = 2^-24, δc the norms' relative difference (4e-7 measured) and |c·g| ≤ ‖c·g‖ ≤ 1 (clipped at 1): ≲ 0.5 · 2 · 5e-7 = 5e-7,
so 1e-6 (measured 6e-8 on two machines and kernels).
AdamW does not: an entry's update is lr · m̂ / (√v̂ + ε), and at the first step lr · g / (|g| + ε), whose derivative in
g is up to lr / ε = 1e5 (lr 1e-3, ε 1e-8): an entry whose gradient is at the ε scale turns a 1e-12 gradient difference
into a 1e-7 weight difference, and only |Δw| ≤ 2 · lr per step bounds it (measured 3.3e-7 on one machine, 1.6e-5 on
another: it depends on the smallest gradients the data happens to give, not on a machine constant). So the AdamW SFT
steps are compared EXACTLY instead: the reference adds the micro-batches in the ranks' order (b0, b2, b1: fp32 a + b
is commutative, so (g0 + g2) + g1 on two ranks is bit-equal to it) and no clipping (grad_clip 0) removes (b).
Losses are sums over micro-batches in float64 (1e-6 relative is loose); gradient norms at 1e-5 relative: a sum of
~10^5 positive squares in another (cascade) order differs by ≲ (log2 n + 2) · u ≈ 1.1e-6 relative (measured 4e-7).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from k3post.config import ConfigError, load_config
from k3post.config.distributed import FSDPConfig
from k3post.data import Sample, collate
from k3post.models import build_tiny_moe, load_model
from k3post.policy_step import TokenSequence, train_policy_step
from k3post.scoring import sequence_logprobs
from k3post.quant.qat import QATConfig, apply_qat
from k3post.stages.sft import sft_step
from k3post.trainer import OptimConfig, Trainer
from k3post.trainer.fsdp import FSDPTrainer, launch_local

VOCAB = 512
SGD = OptimConfig(name="sgd", lr=0.5)
ADAMW = OptimConfig(lr=1e-3)
SFT_LRS = [1e-3, 5e-4, 2e-4]
RANKS_ORDER = [0, 2, 1]  # the order the 2 ranks' gradient sum adds the 3 micro-batches in: (g0 + g2) + g1


@pytest.fixture
def ranks_threads():
    """One torch thread for the in-process reference, as `launch_local` gives each rank (an exact comparison
    needs the same GEMM kernels: a GEMM's summation order may depend on the thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(qat: bool = False) -> torch.nn.Module:
    model = build_tiny_moe(VOCAB, seed=0)
    if qat:
        apply_qat(model, QATConfig())
    return model


def _rl_seqs(model: torch.nn.Module) -> list[TokenSequence]:
    """Five sequences of different lengths (3 micro-batches at 24 tokens: rank 1 runs one idle), behaviour
    log-probs from ``model`` itself (ratio 1: no token falls outside the trust band), advantages of both
    signs."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, VOCAB, (4 + n,), generator=g).tolist() for n in (9, 7, 6, 5, 3)]
    logp = sequence_logprobs(model, ids, 4096)
    return [TokenSequence(s, [False] * 4 + [True] * (len(s) - 4), lp, [0.0] * 4 + [1.0 - 0.5 * j] * (len(s) - 4),
                          [-1] * 4 + [0] * (len(s) - 4)) for j, (s, lp) in enumerate(zip(ids, logp))]


def _sft_batches(step: int) -> list:
    """Step ``step``'s 3 packed micro-batches (grad_accum 3: one rank gets 2, the other 1)."""
    g = torch.Generator().manual_seed(100 + step)
    samples = []
    for n in (12, 9, 15, 8, 11, 10):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        samples.append(Sample(ids, [False] * 3 + [True] * (n - 3), "t"))
    return [collate(samples, rows, 32, 0) for rows in ([[0, 1]], [[2], [3]], [[4, 5]])]


def _two_rank_worker(rank: int, out: str) -> None:
    res: dict = {}
    model = _model(qat=True)
    seqs = _rl_seqs(model)
    tr = FSDPTrainer(model, SGD)
    res["rl"] = [train_policy_step(tr, seqs, pad_id=0, micro_batch_tokens=24, version=0) for _ in range(2)]
    res["rl_w"] = dict(tr.named_weights())
    tr = FSDPTrainer(_model(), ADAMW, grad_clip=0.0)
    res["sft"] = [sft_step(tr, _sft_batches(s), lr=SFT_LRS[s]) for s in range(2)]
    tr.save_checkpoint(Path(out) / "ckpt", 2, state={"losses": [m["loss"] for m in res["sft"]]})
    res["sft"].append(sft_step(tr, _sft_batches(2), lr=SFT_LRS[2]))
    res["sft_w"] = dict(tr.named_weights())
    tr.export_hf(Path(out) / "export")
    bf16 = FSDPTrainer(_model(), ADAMW, mixed_precision="bf16")
    res["bf16"] = sft_step(bf16, _sft_batches(0), lr=SFT_LRS[0])
    res["bf16_dtypes"] = {str(p.dtype) for p in bf16.model.parameters()}
    if rank == 0:
        torch.save(res, Path(out) / "two_ranks.pt")


def _resume_worker(rank: int, out: str, cpu_offload: bool) -> None:
    tr = FSDPTrainer(_model(), ADAMW, cpu_offload=cpu_offload, grad_clip=0.0)
    state = tr.load_checkpoint(Path(out) / "ckpt" / "step-000002")
    step3 = [_sft_batches(2)[i] for i in RANKS_ORDER]  # one rank adds them in the 2 ranks' order: bit-equal
    res = {"state": state, "sft": sft_step(tr, step3, lr=SFT_LRS[2]), "w": dict(tr.named_weights())}
    torch.save(res, Path(out) / f"one_rank_offload{int(cpu_offload)}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp")
    launch_local(_two_rank_worker, 2, str(out))
    return out, torch.load(out / "two_ranks.pt", weights_only=False)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _close(x: float, y: float, rel: float) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y), 1e-12)


def test_rl_steps_on_two_ranks_equal_one_process(two_ranks):
    """policy_step on 2 ranks (QAT on the sharded experts, SGD so the weights scale with the gradient: a
    gradient averaged instead of summed over the ranks would halve the update) = the single-process Trainer."""
    _, res = two_ranks
    model = _model(qat=True)
    seqs = _rl_seqs(model)
    tr = Trainer(model, SGD)
    ref = [train_policy_step(tr, seqs, pad_id=0, micro_batch_tokens=24, version=0) for _ in range(2)]
    for got, want in zip(res["rl"], ref):
        assert got["micro_batches"] == want["micro_batches"] == 3 and got["num_tokens"] == want["num_tokens"]
        for key, rel in (("loss", 1e-6), ("entropy", 1e-6), ("grad_norm", 1e-5)):
            assert _close(got[key], want[key], rel), (key, got[key], want[key])
        assert abs(got["rollout_gap_mean"] - want["rollout_gap_mean"]) < 1e-6
    assert ref[0]["grad_norm"] > 0.01 and ref[0]["rollout_gap_mean"] < 1e-5  # a real gradient; on-policy tokens
    start = dict(_model(qat=True).named_parameters())
    moved = _max_diff({k: v.detach() for k, v in start.items()}, {k: res["rl_w"][k] for k in start})
    assert moved > 1e-3  # the steps changed the weights ...
    assert _max_diff(dict(tr.named_weights()), res["rl_w"]) < 1e-6  # ... as in one process


def test_sft_steps_on_two_ranks_equal_one_process(two_ranks, ranks_threads):
    """3 AdamW SFT steps on 2 ranks = the single-process Trainer, bit for bit (module doc: AdamW has no
    useful elementwise bound for a different reduction order, so the reference adds the micro-batches in the
    ranks' order and neither clips)."""
    _, res = two_ranks
    tr = Trainer(_model(), ADAMW, grad_clip=0.0)
    ref = [sft_step(tr, [_sft_batches(s)[i] for i in RANKS_ORDER], lr=SFT_LRS[s]) for s in range(3)]
    for got, want in zip(res["sft"], ref):
        assert got["target_tokens"] == want["target_tokens"]
        assert _close(got["loss"], want["loss"], 1e-6) and _close(got["grad_norm"], want["grad_norm"], 1e-5)
    assert ref[2]["loss"] < ref[0]["loss"]
    assert _max_diff(dict(tr.named_weights()), res["sft_w"]) == 0.0
    # control: the single-process order (g0 + g1) + g2 is another computation (rounding-level, amplified by AdamW)
    other = Trainer(_model(), ADAMW, grad_clip=0.0)
    for s in range(3):
        sft_step(other, _sft_batches(s), lr=SFT_LRS[s])
    assert _max_diff(dict(other.named_weights()), res["sft_w"]) > 0.0


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_two_rank_checkpoint_resumes_on_one_rank(two_ranks, cpu_offload):
    """The DCP checkpoint of 2 ranks (after step 2) loads on 1 rank; its step 3 equals the uninterrupted
    2-rank step 3 (weights and AdamW moments restored: a fresh optimizer would give another update)."""
    out, res = two_ranks
    ckpt = out / "ckpt" / "step-000002"
    assert (out / "ckpt" / "latest").read_text() == ckpt.name and (ckpt / "dcp" / ".metadata").is_file()
    launch_local(_resume_worker, 1, str(out), cpu_offload)
    one = torch.load(out / f"one_rank_offload{int(cpu_offload)}.pt", weights_only=False)
    assert one["state"]["step"] == 2 and one["state"]["world_size"] == 2
    assert one["state"]["losses"] == [m["loss"] for m in res["sft"][:2]]
    assert _close(one["sft"]["loss"], res["sft"][2]["loss"], 1e-6)
    assert _max_diff(one["w"], res["sft_w"]) == 0.0  # same reduction order, no clipping (module doc): exact
    ref = Trainer(_model(), ADAMW, grad_clip=0.0)  # control: step 3 from step 2's weights with a fresh optimizer is another step
    for s in range(2):
        sft_step(ref, _sft_batches(s), lr=SFT_LRS[s])
    fresh = Trainer(copy.deepcopy(ref.model), ADAMW, grad_clip=0.0)
    sft_step(fresh, _sft_batches(2), lr=SFT_LRS[2])
    assert _max_diff(dict(fresh.named_weights()), res["sft_w"]) > 1e-4


def test_consolidated_export_loads_and_matches(two_ranks):
    out, res = two_ranks
    model = load_model(out / "export")
    sd = model.state_dict()
    for name, t in res["sft_w"].items():
        assert torch.equal(sd[name], t), name
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    ref = _model()
    ref.load_state_dict(res["sft_w"], strict=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert not torch.equal(_model()(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_bf16_mixed_precision_keeps_fp32_masters(two_ranks):
    _, res = two_ranks
    want = sft_step(Trainer(_model(), ADAMW), _sft_batches(0), lr=SFT_LRS[0])
    assert res["bf16_dtypes"] == {"torch.float32"}
    assert res["bf16"]["loss"] != want["loss"] and _close(res["bf16"]["loss"], want["loss"], 1e-2)


def test_fsdp_config_and_trainer_errors():
    assert FSDPConfig(ranks=2, mixed_precision="bf16").ranks == 2
    with pytest.raises(ValueError, match="distributed.fsdp.ranks must be an int >= 1, got 0"):
        FSDPConfig(ranks=0)
    with pytest.raises(ValueError, match="distributed.fsdp.mixed_precision must be one of"):
        FSDPConfig(mixed_precision="fp16")
    assert load_config(overrides=["distributed.fsdp.ranks=2"]).distributed.fsdp.ranks == 2
    with pytest.raises(ValueError, match="distributed.fsdp.ranks must be an int >= 1, got 0"):
        load_config(overrides=["distributed.fsdp.ranks=0"])
    with pytest.raises(ConfigError, match="did you mean 'distributed.fsdp.ranks'"):
        load_config(overrides=["distributed.fsdp.rank=2"])
    with pytest.raises(ValueError, match="needs an initialised process group"):
        FSDPTrainer(_model(), ADAMW)
