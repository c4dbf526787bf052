"""k3post.spec.data: the draft's data are the target's own episodes; the mask marks exactly the tokens the
target sampled; files round-trip and bad lines name file:line."""

from __future__ import annotations

import pytest

from k3post.models import build_tiny_moe
from k3post.rollout import EmbeddedEngine
from k3post.spec.data import DraftSample, load_samples, save_samples, target_generations, token_counts
from k3post.xtml import EOM, XTML

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_target_generations_mask_the_sampled_tokens(xtml_tokenizer, tmp_path) -> None:
    tok = xtml_tokenizer
    x = XTML(tok)
    model = build_tiny_moe(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(EOM))
    engine = EmbeddedEngine(model.eval(), tok, max_batch_size=8, max_model_len=512)
    samples = target_generations(engine, x, ["general.arithmetic"], n_per_family=3, efforts=["low", "max"], max_tokens=12)
    assert len(samples) == 6 and {s.effort for s in samples} == {"low", "max"}
    for s in samples:
        first = s.mask.index(True)
        assert s.ids[:first][-len(x.generation_prefix()):] == x.generation_prefix()  # the prompt ends in the prefix
        assert 0 < sum(s.mask) <= 12  # one sampled turn of at most max_tokens
        assert not any(s.mask[:first])
    counts = token_counts(samples)
    assert sum(counts.values()) == sum(sum(s.mask) for s in samples)
    path = save_samples(samples, tmp_path / "d.jsonl")
    assert load_samples(path) == samples
    path.write_text(path.read_text() + '{"ids": [1, 2], "mask": [1]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:7: not a draft sample"):
        load_samples(path)
    with pytest.raises(ValueError, match="mask entries"):
        DraftSample([1, 2], [True])
