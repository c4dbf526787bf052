"""bench/draft_padding.py: the padded share it reports is the one `train_draft`'s batches have, and a tiny run
prints a paired ratio and α for both arms.

Shape legend: none.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path


from k3post.config.draft import DraftConfig
from k3post.spec.train import epoch_batches

_BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("bench_draft_padding", _BENCH / "draft_padding.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def test_padding_share_counts_the_batches_train_draft_draws():
    lengths = [10, 10, 100, 100, 10, 100, 10, 100, 50, 50, 50, 50]
    cfg = DraftConfig(steps=3, batch_size=4, length_bucket=3, progress=False)
    batches = [epoch_batches(lengths, 4, 0, 0, 3)[s] for s in range(3)]
    want = sum(max(lengths[i] for i in b) * 4 - sum(lengths[i] for i in b) for b in batches) / sum(
        max(lengths[i] for i in b) * 4 for b in batches)
    assert bench.padding_share(lengths, cfg, 0) == want == 0.0  # sorted runs of one length: no padding at all
    plain = DraftConfig(steps=3, batch_size=4, length_bucket=1, progress=False)
    order = random.Random(0).sample(range(12), 12)  # train_draft's random batches: epoch 0 of seed 0, in order
    plain_batches = [[lengths[i] for i in order[4 * s: 4 * s + 4]] for s in range(3)]
    want = sum(max(b) * 4 - sum(b) for b in plain_batches) / sum(max(b) * 4 for b in plain_batches)
    assert want > 0.0 and bench.padding_share(lengths, plain, 0) == want


def test_a_tiny_run_reports_both_arms(capsys, one_torch_thread):
    bench.main(["--sft-steps", "0", "--n-per-family", "1", "--held-per-family", "1", "--max-tokens", "8",
                "--steps", "2", "--repeats", "1", "--batch-size", "2", "--ttt-steps", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["speedup_n"] == 1.0 and len(out["seconds_random"]) == len(out["seconds_bucketed"]) == 1
    assert 0.0 <= out["padding_bucketed"] <= out["padding_random"] < 1.0
    assert 0.0 <= out["alpha0_bucketed"] <= 1.0 and 0.0 <= out["alpha0_random"] <= 1.0
