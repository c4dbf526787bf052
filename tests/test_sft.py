"""SFT trainer: packing, loss masking, schedule, exact resume, bad input, learning."""

import json
import math
from dataclasses import replace

import pytest
import torch

from k3post.data import DataError, Sample, collate, load_sft_jsonl, pack_rows
from k3post.io import write_jsonl
from k3post.models import build_tiny_moe
from k3post.stages.sft import SFTConfig, lr_at, masked_ce_sum, train_sft
from k3post.envs.episode import run_episode_sync
from k3post.envs.families import EFFORTS, get_family
from k3post.xtml import XTML


@pytest.fixture(scope="module")
def tok():
    from k3post.stages.sft_data import default_corpus
    from k3post.tokenizer import train_tokenizer

    return train_tokenizer(default_corpus(2, n_main=30), vocab_size=384)


@pytest.fixture(scope="module")
def xtml(tok):
    return XTML(tok)


def _model(tok, seed=0):
    return build_tiny_moe(len(tok), "tiny", seed=seed, num_hidden_layers=2, pad_token_id=tok.pad_token_id)


def _records(n, seed=0):
    """SFT records of the general.arithmetic reference solver, efforts round-robin."""
    fam = get_family("general.arithmetic")
    recs = []
    for i, t in enumerate(fam.generate(n, seed=seed)):
        effort = EFFORTS[i % 3]
        ep = run_episode_sync(fam.reference_policy(t, effort), fam.make_env(t), t)
        recs.append({"messages": ep.messages, "tools": None, "effort": effort})
    return recs


def test_lr_schedule_golden():
    cfg = SFTConfig(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    # warmup: (s+1)/4
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over 10 steps from 1.0 to 0.1: at progress 0.5 → 0.1 + 0.9 * 0.5 = 0.55
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1)


def test_labels_follow_loss_mask_and_segments():
    # two samples packed in one row; targets only where the *next* token is trainable and in the same sample
    a = Sample(ids=[10, 11, 12, 13], loss_mask=[False, False, True, True], source="a")
    b = Sample(ids=[20, 21, 22], loss_mask=[False, True, True], source="b")
    batch = collate([a, b], [[0, 1]], max_len=16, pad_id=0)
    assert batch.labels_RL.tolist() == [[-100, 12, 13, -100, 21, 22, -100]]
    assert batch.position_ids_RL.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    m = batch.attention_mask_R1LL[0, 0]
    assert not m[4, 3] and m[4, 4] and m[3, 0] and not m[0, 1]  # no attention across samples; causal


def test_pack_rows_first_fit_in_order():
    s = [Sample([1] * n, [True] * n, "") for n in (5, 4, 3, 6)]
    assert pack_rows(s, [0, 1, 2, 3], max_len=9) == [[0, 1], [2, 3]]
    assert pack_rows(s, [3, 2, 1, 0], max_len=9) == [[3, 2], [1, 0]]


def test_microbatches_cover_each_sample_once_within_the_token_budget():
    from k3post.data import iter_microbatches

    lengths = [30, 500, 700, 90, 1900, 64, 1200, 511, 512, 513, 40] * 3
    s = [Sample([1] * n, [True] * n, str(k)) for k, n in enumerate(lengths)]
    batches = list(iter_microbatches(s, pack_len=512, rows_per_batch=4, seed=3, epoch=0))
    seen = sorted(i for b in batches for row in b for i in row)
    assert seen == list(range(len(s)))  # every sample exactly once per epoch
    for b in batches:
        widest = max(sum(len(s[i]) for i in row) for row in b)
        if widest <= 512:
            assert len(b) <= 4  # packed rows of <= 512 tokens
        else:  # long samples sit alone in their row, and the padded micro-batch stays within 4 x 512 tokens
            assert all(len(row) == 1 for row in b) and len(b) * widest <= 4 * 512 or len(b) == 1
    again = list(iter_microbatches(s, pack_len=512, rows_per_batch=4, seed=3, epoch=0))
    assert again == batches
    assert list(iter_microbatches(s, pack_len=512, rows_per_batch=4, seed=3, epoch=1)) != batches


def test_packed_forward_equals_separate(tok, xtml):
    model = _model(tok).eval()
    recs = _records(3)
    samples = [Sample(*_render(xtml, r), source=str(i)) for i, r in enumerate(recs)]
    batch = collate(samples, [[0, 1, 2]], max_len=1024, pad_id=tok.pad_token_id)
    with torch.no_grad():
        packed = masked_ce_sum(model, batch)
        separate = sum(masked_ce_sum(model, collate(samples, [[i]], 1024, tok.pad_token_id)) for i in range(3))
    assert float(packed) == pytest.approx(float(separate), rel=1e-5)


def _render(xtml, rec):
    r = xtml.render(rec["messages"], effort=rec["effort"])
    return list(r.ids), list(r.loss_mask)


def test_grad_accum_equals_big_batch(tok, xtml):
    samples = [Sample(*_render(xtml, r), source="") for r in _records(4)]
    rows = [[0, 1], [2, 3]]
    m1, m2 = _model(tok), _model(tok)
    b_all = collate(samples, rows, 512, tok.pad_token_id)
    n = b_all.n_target_tokens
    (masked_ce_sum(m1, b_all) / n).backward()
    for row in rows:  # two micro-batches, each divided by the step's total target count
        (masked_ce_sum(m2, collate(samples, [row], 512, tok.pad_token_id)) / n).backward()
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        if p1.grad is not None:
            torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-6, msg=name)


def _write(tmp_path, recs, name="train.jsonl"):
    return write_jsonl(tmp_path / name, recs)


def test_resume_gives_identical_losses(tok, xtml, tmp_path):
    path = _write(tmp_path, _records(120))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    cfg = SFTConfig(steps=6, rows_per_batch=2, max_len=512, save_every=3, warmup_steps=2, progress=False, lr=2e-3)
    full = _model(tok)
    r_full = train_sft(full, tok, samples, cfg, tmp_path / "full")
    # interrupted run: stop after 3 steps (a checkpoint), then a fresh process-equivalent resumes
    _train_until(_model(tok), tok, samples, cfg, tmp_path / "part", stop_after=3)
    resumed = _model(tok, seed=123)  # different init: everything must come from the checkpoint
    r_res = train_sft(resumed, tok, samples, cfg, tmp_path / "part")
    assert r_res.resumed_from == 3
    assert r_res.losses == r_full.losses  # bit-identical, steps 1-3 from the checkpoint, 4-6 recomputed
    for p1, p2 in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p1, p2)


@pytest.mark.parametrize("killed_at", [3, 6])
def test_metrics_after_a_kill_equal_an_uninterrupted_run(tok, xtml, tmp_path, monkeypatch, killed_at):
    """Logged every 2 steps, checkpointed every 3, killed inside the save of step 3 (no checkpoint yet; the
    row of step 2 is on disk) or of step 6 (resumes from 3, between two logged rows). The rerun's metrics
    rows equal the uninterrupted run's (apart from wall-clock fields). Before the fix the first case kept
    the killed run's step-2 row twice and the second logged at step 4 the loss of step 4 alone, not of
    steps 3-4."""
    import k3post.checkpoint as checkpoint
    from k3post.metrics import MetricsLogger, read_metrics

    path = _write(tmp_path, _records(40))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    cfg = SFTConfig(steps=8, rows_per_batch=2, max_len=512, save_every=3, log_every=2, warmup_steps=2, progress=False, lr=2e-3)

    def rows(run):
        return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")} for r in read_metrics(run / "metrics.jsonl")]

    def train(run):
        m = MetricsLogger(run, tensorboard=False)
        train_sft(_model(tok), tok, samples, cfg, run / "sft", metrics=m)

    train(tmp_path / "full")
    real = checkpoint.save_checkpoint

    def killed(root, step, *a, **kw):
        if step == killed_at:
            raise KeyboardInterrupt  # the process dies inside the write
        return real(root, step, *a, **kw)

    monkeypatch.setattr(checkpoint, "save_checkpoint", killed)  # the trainer writes through it
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "part")
    monkeypatch.setattr(checkpoint, "save_checkpoint", real)
    train(tmp_path / "part")
    assert [r["step"] for r in rows(tmp_path / "part")] == [2, 4, 6, 8]
    assert rows(tmp_path / "part") == rows(tmp_path / "full")


def _train_until(model, tok, samples, cfg, out, stop_after):
    """Run the trainer and 'kill' it right after the checkpoint at `stop_after` by raising from the save hook."""
    import k3post.checkpoint as ck  # the trainer writes through k3post.checkpoint.save_checkpoint

    real = ck.save_checkpoint

    class Killed(Exception):
        pass

    def save_then_die(root, step, *a, **kw):
        path = real(root, step, *a, **kw)
        if step == stop_after:
            raise Killed
        return path

    ck.save_checkpoint = save_then_die
    try:
        with pytest.raises(Killed):
            train_sft(model, tok, samples, cfg, out)
    finally:
        ck.save_checkpoint = real


@pytest.mark.parametrize("qat", [False, True], ids=["fp32", "mxfp4-qat"])
def test_sft_learns(tok, xtml, tmp_path, qat):
    from k3post.quant.qat import QATConfig, apply_qat

    path = _write(tmp_path, _records(16))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    cfg = SFTConfig(steps=40, rows_per_batch=2, max_len=512, pack_len=512, save_every=100, warmup_steps=5, lr=3e-3, progress=False)
    model = _model(tok)
    if qat:
        assert len(apply_qat(model, QATConfig())) == 4  # 2 layers x (gate_up_proj, down_proj)
    res = train_sft(model, tok, samples, cfg, tmp_path / "out")
    assert res.losses[0] > 3.0
    assert res.losses[-1] < 0.3 * res.losses[0]  # memorising 16 samples: loss falls by > 3x in 40 steps


@pytest.mark.parametrize(
    "line,match",
    [
        ("{not json", r"train.jsonl:2: malformed JSON"),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), r"train.jsonl:2: .*unknown role 'robot'"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "rm", "arguments": "{}"}}]}],
                        "tools": []}),
            r"train.jsonl:2: .*undeclared tool 'rm'",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x " * 3000}, {"role": "assistant", "content": "y"}]}),
         r"train.jsonl:2: sample is \d+ tokens, longer than max_len=400"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "effort": "huge"}), r"train.jsonl:2: .*effort"),
    ],
)
def test_bad_input_names_file_and_line(tok, xtml, tmp_path, line, match):
    good = json.dumps(_records(1)[0])
    p = tmp_path / "train.jsonl"
    p.write_text(good + "\n" + line + "\n" + good + "\n")
    with pytest.raises(DataError, match=match):
        load_sft_jsonl(p, xtml, max_len=400)
    samples, stats = load_sft_jsonl(p, xtml, max_len=400, on_bad_sample="skip")
    assert len(samples) == 2 and stats.read == 3 and sum(stats.skipped.values()) == 1
    assert p.read_text().count("\n") == 3  # the input file is never touched


def test_bf16_autocast_trains(tok, xtml, tmp_path):
    path = _write(tmp_path, _records(16))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    cfg = SFTConfig(steps=20, rows_per_batch=2, max_len=512, save_every=100, warmup_steps=2, precision="bf16", progress=False)
    model = _model(tok)
    res = train_sft(model, tok, samples, cfg, tmp_path / "out")
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert res.losses[-1] < 0.5 * res.losses[0]
    with pytest.raises(ValueError, match="precision"):
        train_sft(model, tok, samples, SFTConfig(precision="fp8"), tmp_path / "o2")


def test_sft_command_from_init_model(tmp_path):
    from k3post.cli import main
    from k3post.metrics import read_metrics

    assert main(["init-model", str(tmp_path / "m"), "--vocab-size", "320"]) == 0
    data = _write(tmp_path, _records(40))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run:\n  root: {tmp_path}\n  name: r\nmodel:\n  path: {tmp_path / 'm'}\nsft:\n  steps: 12\n  rows_per_batch: 2\n  log_every: 4\n  progress: false\n")
    assert main(["sft", str(cfg), f"sft.train_file={data}", "sft.lr=2e-3"]) == 0
    assert (tmp_path / "r" / "sft" / "final" / "model.safetensors").exists()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl", "sft")
    assert [r["step"] for r in rows] == [4, 8, 12] and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["lr"] < 2e-3  # warmup
    # a missing data file is a clear error, not a traceback
    assert main(["sft", str(cfg), f"sft.train_file={tmp_path / 'nope.jsonl'}"]) == 2


def test_sft_command_without_data_file_synthesizes_the_builtin_set(tmp_path):
    """The issue's example command: `k3post sft configs/demo.yaml sft.lr=3e-4` (shrunk to run fast)."""
    from pathlib import Path

    from k3post.cli import main

    cfg = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert main([
        "sft", str(cfg), "sft.lr=3e-4", f"run.root={tmp_path}", "run.name=s", "data.n_train=10", "data.n_per_family=1",
        "data.family_tasks.agents.search=1", "data.family_tasks.coding.write_function=1",
        "data.corpus_per_family=1", "tokenizer.vocab_size=400", "sft.max_len=4096", "sft.rows_per_batch=1",
        "sft.steps=2", "sft.progress=false",
    ]) == 0
    run = tmp_path / "s"
    assert (run / "data" / "sft_train.jsonl").exists() and (run / "sft" / "final" / "model.safetensors").exists()
    assert "lr: 0.0003" in (run / "config.yaml").read_text()


def test_sft_device_cuda_without_cuda_fails_closed_before_training(tok, xtml, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu test below runs instead")
    path = _write(tmp_path, _records(4))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    model = _model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="'cuda' asked for, but torch sees no CUDA device"):
        train_sft(model, tok, samples, SFTConfig(steps=2, device="cuda", progress=False), tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained, nothing moved
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_packed_batch_moves_whole(tok, xtml, tmp_path):
    path = _write(tmp_path, _records(3))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    b = collate(samples, [[0, 1], [2]], 1024, tok.pad_token_id)
    assert b.to("cpu") is b  # already there: no copy
    m = b.to("meta")
    assert {t.device.type for t in (m.input_ids_RL, m.position_ids_RL, m.attention_mask_R1LL, m.labels_RL)} == {"meta"}
    assert m.segments == b.segments


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qat", [False, True])
def test_sft_on_cuda_matches_cpu_and_resumes(tok, xtml, tmp_path, qat):
    """sft.device=cuda trains the same model as the CPU: the first loss (one forward of the same weights) within
    fp32 summation error (~1e-6 relative over ~10^3 terms of reordered sums), later steps within 1e-3 (the
    reordering grows through 6 AdamW steps); the model comes back to the CPU; a resumed CUDA run equals an
    uninterrupted one within 1e-4 (CUDA's atomic adds in the MoE scatter are not bit-reproducible run to run)."""
    from k3post.quant.qat import QATConfig, apply_qat

    path = _write(tmp_path, _records(24))
    samples, _ = load_sft_jsonl(path, xtml, max_len=512)
    cfg = SFTConfig(steps=6, rows_per_batch=2, max_len=512, save_every=3, warmup_steps=2, progress=False, lr=2e-3)

    def model():
        m = _model(tok)
        if qat:
            apply_qat(m, QATConfig())
        return m

    cpu, gpu = model(), model()
    r_cpu = train_sft(cpu, tok, samples, cfg, tmp_path / "cpu")
    r_gpu = train_sft(gpu, tok, samples, replace(cfg, device="cuda"), tmp_path / "gpu")
    assert next(gpu.parameters()).device.type == "cpu"
    assert r_gpu.losses[0] == pytest.approx(r_cpu.losses[0], rel=1e-5)
    assert r_gpu.losses == pytest.approx(r_cpu.losses, rel=1e-3)
    _train_until(model(), tok, samples, replace(cfg, device="cuda"), tmp_path / "part", stop_after=3)
    r_res = train_sft(model(), tok, samples, replace(cfg, device="cuda"), tmp_path / "part")
    assert r_res.resumed_from == 3 and r_res.losses == pytest.approx(r_gpu.losses, rel=1e-4)
