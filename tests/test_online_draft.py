"""The draft that follows the policy (issue 35, `k3post.spec.online`): trained online on the policy's rollouts,
the draft alone moves (not the policy, not their shared embedding), the engine drafts with the new weights, and
its state round-trips.

Target: test_speculative's tiny Qwen3-MoE (vocabulary 64, 2 layers). Draft: ``Eagle3Draft.from_target`` with aux
ids (1, 1, 2), fc perturbed off its [0 0 I] start.
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3post.config.draft import DraftConfig
from k3post.config.rollout import EngineConfig
from k3post.rollout.factory import build_engine
from k3post.spec.data import DraftSample
from k3post.spec.eagle3 import Eagle3Draft
from k3post.spec.export import export_eagle3
from k3post.spec.online import OnlineDraft
from k3post.spec.train import evaluate_alpha
from tests.test_speculative import _requests, _target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = (1, 1, 2)
CFG = DraftConfig(lr=3e-3, batch_size=6, max_len=64, ttt_steps=2, progress=False)


def _engine(tmp_path, target):
    draft = Eagle3Draft.from_target(target, AUX)
    with torch.no_grad():
        draft.fc.weight.add_(torch.randn(draft.fc.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    folder = export_eagle3(draft, tmp_path / "eagle3", nonstock=True)
    return build_engine(target, engine=EngineConfig(draft=str(folder), num_draft_tokens=2), max_batch_size=6,
                        stop_ids=())


def _samples(engine) -> list[DraftSample]:
    res = engine.generate(_requests(6))
    return [DraftSample(r.prompt_ids + r.output_ids, [False] * len(r.prompt_ids) + [True] * len(r.output_ids))
            for r in res]


def test_online_steps_train_the_draft_alone_and_the_engine_drafts_with_it(tmp_path):
    target = _target()
    engine = _engine(tmp_path, target)
    drafter = engine.speculative.drafter
    samples = _samples(engine)
    policy0 = copy.deepcopy(target.state_dict())
    target.requires_grad_(True)  # as the RL trainer holds it
    draft0 = copy.deepcopy(drafter.draft.state_dict())
    frozen = OnlineDraft(drafter, target, CFG, steps=0, pad_id=0)
    assert frozen.step(samples) == {}
    assert all(torch.equal(v, drafter.draft.state_dict()[k]) for k, v in draft0.items())
    alpha0 = evaluate_alpha(target, drafter.draft, samples, CFG, 0)["t1"][0]
    online = OnlineDraft(drafter, target, CFG, steps=20, pad_id=0)
    m = online.step(samples)
    assert set(m) == {"loss", "alpha_0", "alpha_1"}
    alpha1 = evaluate_alpha(target, drafter.draft, samples, CFG, 0)["t1"][0]
    assert alpha1 > alpha0 + 0.02, (alpha0, alpha1)  # it learns the policy it drafts for
    after = target.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in policy0.items())  # the policy and the shared embedding stay
    assert all(p.requires_grad for p in target.parameters())  # flags restored
    moved = [k for k, v in draft0.items() if not torch.equal(v, drafter.draft.state_dict()[k])]
    assert "fc.weight" in moved and not any(k.startswith("embed_tokens.") for k in moved)
    # the engine's drafter re-read the weights: its proposals are the trained draft's
    attn = drafter.draft.midlayer.self_attn
    assert "midlayer.self_attn.q_proj.weight" in moved
    assert torch.equal(drafter._w.qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    state = online.state_dict()
    again = OnlineDraft(drafter, target, CFG, steps=20, pad_id=0)
    with torch.no_grad():
        drafter.draft.fc.weight.zero_()
    again.load_state_dict(state)
    assert torch.equal(drafter.draft.fc.weight, state["draft"]["fc.weight"]) and again.rl_step == 1
    with pytest.raises(ValueError, match="lacks"):
        again.load_state_dict({**state, "draft": {}})


def test_only_an_eagle3_drafter_can_follow():
    class NotEagle:
        draft = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="EAGLE-3"):
        OnlineDraft(NotEagle(), _target(), CFG, steps=1, pad_id=0)
