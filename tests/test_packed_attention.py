"""Packed attention (`k3post.packed_attention`): one causal SDPA per sample equals the masked packed rows."""

from dataclasses import replace

import pytest
import torch

from k3post.data import Sample, collate
from k3post.models import build_tiny_moe
from k3post.packed_attention import IMPLEMENTATION, packed_sdpa, use_packed_attention
from k3post.stages.sft import masked_ce_sum

VOCAB = 96


def _model(seed=0):
    return build_tiny_moe(VOCAB, "tiny", seed=seed, num_hidden_layers=2, pad_token_id=0)


def _batch(lengths_per_row, seed=0):
    """Rows packed from samples of the given lengths (random ids, every token trained), padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    samples, rows = [], []
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
            samples.append(Sample(ids=ids, loss_mask=[True] * n, source=f"s{len(samples)}"))
            row.append(len(samples) - 1)
        rows.append(row)
    return collate(samples, rows, max_len=512, pad_id=0)


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = masked_ce_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_collate_records_each_rows_sample_lengths():
    b = _batch([[5, 3], [7], [2, 2, 2]])
    assert b.segments == ((5, 3), (7,), (2, 2, 2))
    assert b.input_ids_RL.shape == (3, 8)  # the longest row; the others padded


@pytest.mark.parametrize("rows", [[[40, 25, 60], [90], [10, 10, 10, 10]], [[128], [100]]])
def test_per_sample_attention_equals_the_masked_rows(rows):
    """Loss and every gradient of the packed-attention forward equal the masked-SDPA forward's (padding
    included). Both sum the same products in fp32 in another order: the loss, a sum of ~200 terms of size ~4, and
    each gradient may differ by a few ulps of the largest term; bounds at 1e-5 relative are ~100 ulps."""
    model = _model()
    batch = _batch(rows)
    ref_loss, ref_grads = _loss_and_grads(model, replace(batch, segments=None))
    assert model.config._attn_implementation == "sdpa"  # no segments: the model was not switched
    loss, grads = _loss_and_grads(model, batch)
    assert model.config._attn_implementation == IMPLEMENTATION
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-12)
        assert (g - ref_grads[name]).abs().max() <= 1e-5 * scale, name


def test_a_crossed_boundary_would_show():
    """The check above can fail: rows whose samples are declared as one (attention across the boundary) give
    another loss than the masked rows."""
    model = _model()
    batch = _batch([[40, 25, 60]])
    ref_loss, _ = _loss_and_grads(model, replace(batch, segments=None))
    merged, _ = _loss_and_grads(model, replace(batch, segments=((125,),)))
    assert abs(merged.item() - ref_loss.item()) > 1e-3 * abs(ref_loss.item())


def test_calls_without_segments_are_hfs_sdpa_bit_for_bit():
    """A switched model runs HF's SDPA for every call that passes no segments (generation, the engine's HF path)."""
    a, b = _model(), _model()
    assert use_packed_attention(b) and b.config._attn_implementation == IMPLEMENTATION
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: HF's padded causal mask
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids, attention_mask=mask).logits, b(input_ids=ids, attention_mask=mask).logits)


def test_bad_segments_are_named():
    q = torch.zeros(2, 4, 10, 8)
    kv = torch.zeros(2, 2, 10, 8)
    with pytest.raises(ValueError, match="holds 1 rows for a batch of 2"):
        packed_sdpa(torch.nn.Module(), q, kv, kv, None, packed_segments=[[10]])
    with pytest.raises(ValueError, match="row 1: its samples hold 12 tokens, more than the row's 10"):
        packed_sdpa(torch.nn.Module(), q, kv, kv, None, packed_segments=[[10], [6, 6]])


def test_other_implementations_are_left_alone():
    model = build_tiny_moe(VOCAB, "tiny", seed=0, num_hidden_layers=2, pad_token_id=0)
    model.set_attn_implementation("eager")
    assert not use_packed_attention(model) and model.config._attn_implementation == "eager"
