"""k3post.spec.train: the draft learns the target (α at depth 0 rises on held-out episodes), the target stays
frozen, a run stopped halfway and resumed ends with the same weights as an uninterrupted one, and
`k3post draft` runs end to end on a saved checkpoint (data, training, export, summary)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from k3post.config.draft import DraftConfig
from k3post.models import build_tiny_moe, save_model
from k3post.rollout import EmbeddedEngine
from k3post.spec.data import target_generations
from k3post.spec.eagle3 import Eagle3Draft
from k3post.spec.train import evaluate_alpha, train_draft
from k3post.xtml import EOM, XTML

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def world(xtml_tokenizer):
    tok = xtml_tokenizer
    target = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM),
                            initializer_range=0.2, **TINY).eval()
    engine = EmbeddedEngine(target, tok, max_batch_size=16, max_model_len=512)
    samples = target_generations(engine, XTML(tok), ["general.arithmetic"], n_per_family=12, efforts=["low", "max"],
                                 max_tokens=24, seed=3)
    return tok, target, samples[:20], samples[20:]


def _cfg(**kw) -> DraftConfig:
    return replace(DraftConfig(steps=12, lr=3e-3, batch_size=4, ttt_steps=3, save_every=6, log_every=1, warmup_steps=2,
                               progress=False), **kw)


def _draft(target) -> Eagle3Draft:
    torch.manual_seed(0)
    return Eagle3Draft.from_target(target, (1, 1, 2))


def test_draft_learns_the_target_and_leaves_it_frozen(world, tmp_path) -> None:
    tok, target, train, held = world
    before_target = {n: p.clone() for n, p in target.state_dict().items()}
    draft = _draft(target)
    cfg = _cfg(steps=30, save_every=30)
    a0 = evaluate_alpha(target, draft, held, cfg, tok.pad_token_id)
    res = train_draft(target, draft, train, cfg, tmp_path, pad_id=tok.pad_token_id)
    a1 = evaluate_alpha(target, draft, held, cfg, tok.pad_token_id)
    assert a1["t1"][0] > a0["t1"][0] + 0.02, (a0, a1)
    assert all(0 <= a <= 1 for v in a1.values() for a in v)
    assert res.history[-1]["loss"] < res.history[0]["loss"]
    assert all(torch.equal(before_target[n], p) for n, p in target.state_dict().items())


def test_resume_equals_an_uninterrupted_run(world, tmp_path, monkeypatch) -> None:
    import k3post.spec.train as T

    tok, target, train, _ = world
    full = _draft(target)
    train_draft(target, full, train, _cfg(), tmp_path / "full", pad_id=tok.pad_token_id)
    save = T.save_checkpoint

    def killed_after_step_6(root, step, *a, **kw):
        save(root, step, *a, **kw)
        if step == 6:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(T, "save_checkpoint", killed_after_step_6)
    with pytest.raises(KeyboardInterrupt):
        train_draft(target, _draft(target), train, _cfg(), tmp_path / "cut", pad_id=tok.pad_token_id)
    monkeypatch.setattr(T, "save_checkpoint", save)
    resumed = _draft(target)
    cfg = _cfg()
    res = train_draft(target, resumed, train, cfg, tmp_path / "cut", pad_id=tok.pad_token_id)
    assert [h["step"] for h in res.history] == list(range(7, 13))
    for (n, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("bucket", [1, 8])
def test_the_draft_trains_through_the_trainer_as_a_plain_adamw_loop(world, tmp_path, bucket) -> None:
    """`train_draft` steps through the trainer (`build_trainer`, `DraftGrads`): bit for bit the plain loop the
    stage ran before (torch's AdamW at its default betas and eps, `clip_grad_norm_`, the same batches: random ones
    with ``length_bucket`` 1, `epoch_batches` otherwise), with clipping active; the draft is left in eval mode and
    the shared embedding untouched."""
    import random

    from k3post.stages.sft import lr_at
    from k3post.spec.eagle3 import step_weights
    from k3post.spec.train import draft_batch, draft_step_losses, epoch_batches

    tok, target, train, _ = world
    cfg = _cfg(steps=3, save_every=3, grad_clip=0.05, weight_decay=0.01, length_bucket=bucket)
    got = _draft(target)
    embed = got.embed_tokens.weight.clone()
    res = train_draft(target, got, train, cfg, tmp_path, pad_id=tok.pad_token_id)
    ref = _draft(target)
    params = [p for n, p in ref.named_parameters() if not n.startswith("embed_tokens.")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    weights, norms = step_weights(cfg.ttt_steps, cfg.step_decay), []
    for step in range(cfg.steps):
        per_epoch = len(train) // cfg.batch_size
        if bucket == 1:
            order = random.Random(step // per_epoch).sample(range(len(train)), len(train))
            batch = [train[order[(step * cfg.batch_size + j) % len(train)]] for j in range(cfg.batch_size)]
        else:
            lengths = [min(len(s.ids), cfg.max_len) for s in train]
            batch = [train[i] for i in epoch_batches(lengths, cfg.batch_size, 0, step // per_epoch, bucket)[step % per_epoch]]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids_BT, sampled_BT, real_BT = draft_batch(batch, cfg.max_len, tok.pad_token_id)
        losses = draft_step_losses(target, ref, ids_BT, sampled_BT, real_BT, cfg, tok.pad_token_id)
        loss = sum(float(weights[i]) * dl.loss for i, dl in enumerate(losses))
        # bucketed batches weigh each step by its sampled tokens against the mean batch's (DraftGrads)
        per_step = cfg.batch_size * sum(sum(s.mask[: cfg.max_len]) for s in train) / len(train)
        scale = float(sampled_BT.sum()) / per_step if bucket > 1 else 1.0
        opt.zero_grad(set_to_none=True)
        (loss * scale if scale != 1.0 else loss).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)))
        opt.step()
        assert res.history[step]["loss"] == float(loss.detach()), step
    assert min(norms) > cfg.grad_clip  # every step clipped
    for (n, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n
    assert not got.training and torch.equal(got.embed_tokens.weight, embed)


def _draft_args(tmp_path, folder, *extra: str) -> list[str]:
    return ["draft", "configs/demo.yaml", f"run.root={tmp_path}", "run.name=r", f"draft.target={folder}",
            "draft.families=[general.arithmetic]", "draft.n_per_family=6", "draft.efforts=[low]", "draft.max_tokens=16",
            "draft.steps=4", "draft.batch_size=2", "draft.ttt_steps=2", "draft.progress=false", "draft.draft_vocab=200",
            "qat.enabled=false", *extra]


def test_k3post_draft_command(world, tmp_path) -> None:
    """`k3post draft` on a saved 4-layer target: data, training, held-out α table, and an export that stock vLLM
    and SGLang load and feed (tests/test_spec_export.py's checkers): the default aux ids (1, 2, 3)."""
    from k3post.cli import main
    from k3post.models import load_model
    from tests.test_spec_export import serves_on_stock_engines

    tok, _, _, _ = world
    target = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM),
                            initializer_range=0.2, **{**TINY, "num_hidden_layers": 4}).eval()
    folder = save_model(target, tmp_path / "target", tok)
    assert main(_draft_args(tmp_path, folder)) == 0
    out = tmp_path / "r" / "draft"
    summary = json.loads((out / "summary.json").read_text())
    got = summary["losses"]["lk_alpha"]
    assert len(got["acceptance_by_depth"]["t1"]) == len(got["acceptance_by_depth"]["t0"]) == 2
    assert summary["aux_layers"] == [1, 2, 3] and summary["mtp_init"] is None
    assert (out / "lk_alpha" / "checkpoints" / "latest").is_file()
    ids_BT = torch.randint(0, len(tok), (2, 9), generator=torch.Generator().manual_seed(0))
    serves_on_stock_engines(load_model(folder).eval(), out / "lk_alpha" / "final", ids_BT, (1, 2, 3))


def test_k3post_draft_refuses_a_non_stock_layout_before_generating_data(world, tmp_path, capsys) -> None:
    """draft.aux_layers that stock vLLM / SGLang cannot feed (the final layer's output, id L) and the default on a
    target too shallow for three recordable states exit 2 naming the key, before any draft data is generated."""
    from k3post.cli import main

    tok, target, _, _ = world  # 2 layers
    folder = save_model(copy.deepcopy(target), tmp_path / "target", tok)
    assert main(_draft_args(tmp_path, folder, "draft.aux_layers=[1,1,2]")) == 2
    err = capsys.readouterr().err
    assert "draft.aux_layers=[1, 1, 2]" in err and "draft.nonstock_export=true" in err and "shape error" in err
    assert main(_draft_args(tmp_path, folder)) == 2
    assert "fewer than 3 states" in capsys.readouterr().err
    assert not (tmp_path / "r" / "draft").exists()


def test_draft_aux_layers_resolution() -> None:
    """Empty: the stock default; out of range: an error; non-stock: an error unless draft.nonstock_export."""
    from k3post.recipes.commands import draft_aux_layers
    from k3post.errors import UserError

    assert draft_aux_layers(DraftConfig(), 12) == (1, 6, 11)
    assert draft_aux_layers(DraftConfig(aux_layers=[2, 6, 9]), 12) == (2, 6, 9)
    with pytest.raises(UserError, match="ids must be in 0..12"):
        draft_aux_layers(DraftConfig(aux_layers=[1, 6, 13], nonstock_export=True), 12)
    with pytest.raises(UserError, match="draft.nonstock_export=true"):
        draft_aux_layers(DraftConfig(aux_layers=[1, 6, 12]), 12)
    assert draft_aux_layers(DraftConfig(aux_layers=[1, 6, 12], nonstock_export=True), 12) == (1, 6, 12)


def test_fit_fc_starts_the_draft_at_the_final_hidden_state(world) -> None:
    """With the high aux id below L (the stock layouts), ``fit_fc`` sets fc to the ridge least-squares map onto the
    final hidden state (the MTP head's input): fc(fused) is nearer to it than [0 0 I]'s h_high, and W satisfies the
    ridge normal equations Xᵀ(XWᵀ − Y) = −λWᵀ, λ = 1e-4 · mean diag XᵀX, up to W's rounding to float32 (each
    entry off by ≤ 2⁻²⁴ relative, so the two sides differ by ≤ 2⁻²⁴ · (|XᵀX| + λI) |Wᵀ|; float64 elsewhere). With
    id L, [0 0 I] is exact and fc is left alone."""
    from k3post.spec.eagle3 import target_features
    from k3post.spec.train import draft_batch, fit_fc

    tok, target, train, _ = world
    cfg = _cfg()
    draft = _draft(target)
    assert fit_fc(target, draft, train, cfg, tok.pad_token_id) == 0  # (1, 1, 2): id L = 2
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(target, (1, 1, 1))
    ids_BT, _, real_BT = draft_batch(train, cfg.max_len, tok.pad_token_id)
    fused, final = target_features(target, ids_BT, (1, 1, 1), attention_mask=real_BT.long())
    X, Y = fused[real_BT].double(), final[real_BT].double()
    before = float((X @ draft.fc.weight.detach().double().T - Y).pow(2).sum())
    assert fit_fc(target, draft, train, cfg, tok.pad_token_id) == int(real_BT.sum())
    W = draft.fc.weight.detach().double()
    R = X @ W.T - Y
    assert float(R.pow(2).sum()) < before
    G = X.T @ X
    lam = 1e-4 * G.diagonal().mean()
    err = (X.T @ R + lam * W.T).abs()  # = (G + λI) δᵀ, δ = W's float32 rounding
    bound = 2.0 ** -24 * ((G.abs() + lam * torch.eye(len(G), dtype=G.dtype)) @ W.T.abs())
    assert bool((err <= 2 * bound).all()), float((err / bound).max())  # x2: float64 solve / sums, ~1e-12 relative


def test_expected_accept_length() -> None:
    """1 + α0 + α0·α1 + … (hand values): α = [0.5, 0.4, 0.2] → k=1: 1.5, k=2: 1.7, k=3: 1.74."""
    from k3post.spec.train import expected_accept_length

    assert [expected_accept_length([0.5, 0.4, 0.2], k) for k in (1, 2, 3)] == pytest.approx([1.5, 1.7, 1.74])
    assert expected_accept_length([1.0] * 5, 5) == 6.0
    with pytest.raises(ValueError, match="needs acceptance at 4 depths"):
        expected_accept_length([0.5] * 3, 4)


def test_draft_mtp_resolution(world, tmp_path) -> None:
    """draft.mtp: empty finds the target's own head, else the run's SFT model's (the demo's MOPD student has none;
    its SFT model does); "none" skips it; a named folder without a head is an error naming the key."""
    from k3post.recipes.commands import _draft_mtp
    from k3post.errors import UserError
    from k3post.spec.mtp import MTPHead, save_mtp

    _, target, _, _ = world
    run, student = tmp_path / "run", tmp_path / "run" / "mopd" / "final"
    student.mkdir(parents=True)
    assert _draft_mtp("", student, run) == (None, None)
    head = MTPHead.from_target(target)
    (run / "sft" / "final").mkdir(parents=True)
    save_mtp(head, run / "sft" / "final")
    got, where = _draft_mtp("", student, run)
    assert where == str(run / "sft" / "final")
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), head.state_dict().values()))
    save_mtp(MTPHead.from_target(target), student)
    assert _draft_mtp("", student, run)[1] == str(student)  # the target's own head first
    assert _draft_mtp("none", student, run) == (None, None)
    with pytest.raises(UserError, match="draft.mtp: .* has no MTP head"):
        _draft_mtp(str(tmp_path), student, run)


def test_epoch_batches_bucket_by_length_and_cover_the_epoch() -> None:
    """Length bucketing: each sample at most once an epoch (every one when the batch size divides n), batches of
    near lengths (padding far below random batches'), a pure function of (seed, epoch), n < batch one batch."""
    import random

    from k3post.spec.train import epoch_batches

    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(20, 80), rng.randint(300, 768)]) for _ in range(96)]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    got = epoch_batches(lengths, 8, seed=3, epoch=2, bucket=8)
    assert len(got) == 12 and all(len(b) == 8 for b in got)
    assert sorted(i for b in got for i in b) == list(range(96))
    assert got == epoch_batches(lengths, 8, seed=3, epoch=2, bucket=8)
    assert got != epoch_batches(lengths, 8, seed=3, epoch=3, bucket=8)
    plain = epoch_batches(lengths, 8, seed=3, epoch=2, bucket=1)  # runs of one batch: random batches
    assert sorted(i for b in plain for i in b) == list(range(96))
    assert padding(got) < 0.25 * padding(plain)
    odd = epoch_batches(lengths[:21], 8, seed=0, epoch=0, bucket=8)  # 21 // 8 = 2 full batches, 5 left for later
    assert len(odd) == 2 and len({i for b in odd for i in b}) == 16
    assert epoch_batches(lengths[:5], 8, seed=0, epoch=0, bucket=8) == [random.Random(0).sample(range(5), 5)]
