"""configs/full.yaml, the nine-experts recipe (issue 16), scaled down to what a slow test can afford.

The recipe's SFT is kept as it is (the agentic and coding skills come from it); RL trains only the max expert
of agents and coding, MOPD is skipped. What must hold: RL at max beats its SFT start on the same held-out
tasks (exact McNemar, p < 0.05) in both domains, so a regression in agentic learning is caught.
About 45 minutes on the 2-core CPU (docs/decisions.md, "The full recipe").

It does not hold yet at this scale and is marked xfail (strict: the day it passes, the mark must go). The
full recipe's first run (docs/decisions.md): agents SFT 0/100 at max (the tiny model does not copy the
question's entity), coding 0.35 → 0.35 after RL at max (p 1.0).
"""

import json
from pathlib import Path

import pytest

from k3post.cli import main

FULL = Path(__file__).resolve().parents[1] / "configs" / "full.yaml"


def _scaled_down(tmp_path):
    return [f"run.root={tmp_path}", "run.name=full_small", "sft.progress=false", "rl.progress=false",
            "rl.domains=[agents,coding]", "rl.effort_control.curriculum=[max]", "mopd.rl.steps=0",
            "eval.efforts=[max]", "data.n_train=300", "data.n_eval=100"]


def test_full_recipe_config_loads_and_sizes_every_domain_for_the_targets():
    """Every domain's "before" row and experts are evaluated on >= 100 held-out tasks (the SFT target's n), the
    per-turn caps leave room for the references (checked when RL starts), and all seven families train."""
    from k3post.config import load_config
    from k3post.envs.families import default_families
    from k3post.envs.families.streams import domain_families

    cfg = load_config(str(FULL), [])
    # the AET families (issue 21) came after this recipe was measured; it trains every other family
    assert set(cfg.rl.families) == {f.name for f in default_families()}
    assert cfg.rl.judge == "policy" and not cfg.demo.compare_no_qat
    for d in cfg.rl.domains:
        n = cfg.rl.for_domain(d).eval_n * len(domain_families(d, cfg.rl.families, with_judge=True))
        assert n >= 100, (d, n)
    assert cfg.tokenizer.lexicon_repeats > 0


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured: agents SFT 0/100 and coding RL 0.35 -> 0.35 at the tiny CPU scale "
                                       "(docs/decisions.md, 'The full recipe')")
def test_full_recipe_scaled_down_agents_and_coding_rl_beat_sft(tmp_path):
    assert main(["demo", str(FULL), *_scaled_down(tmp_path)]) == 0
    s = json.loads((tmp_path / "full_small" / "summary.json").read_text())
    ex = s["experts"]
    assert set(ex) == {"agents.max", "coding.max"}
    for d in ("agents", "coding"):
        e = ex[f"{d}.max"]
        assert e["n"] >= 100
        assert e["change"]["verdict"] == "higher", (d, e["sft_pass_rate"], e["pass_rate"], e["change"])
