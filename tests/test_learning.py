"""Learning checks: the default test run fails when learning breaks.

Each check trains a tiny Qwen3-MoE (hidden 64, 2 layers, 4 experts) for seconds on a micro task with a
fixed seed, and asserts an effect with a margin well outside its noise (the measured values and the noise
across seeds are in docs/decisions.md):

* SFT lowers the held-out loss and raises the held-out pass rate (general.faithfulness, effort low:
  copy the asked fact from the context);
* QAT SFT (MXFP4 / MXFP8 from the first step) learns the same;
* RL raises the sampled reward on tasks the SFT model solves part of the time;
* the effort override (−1 over τ·b0) shortens the thinking of a model SFT-ed at effort max;
* MOPD lowers the student's reverse KL to a teacher on its own samples (a student that starts off the teacher).

``--inject-bug NAME`` plants a bug in the library for a run of this module, to show the checks catch it
(each must then fail): ``loss_mask`` (SFT trains on every token it should not, and on none it should),
``advantage_sign`` (RL's group advantages negated), ``override_off`` (the effort override returns the
rewards unchanged), ``teacher_student`` (MOPD's per-token reward computed with teacher and student swapped).

    python3 -m pytest tests/test_learning.py --inject-bug advantage_sign      # the RL check fails

Shape legend: none (the math is in the library).
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import pytest
import torch

from k3post.data import Sample, render_record
from k3post.envs.families import get_family
from k3post.models import build_tiny_moe, save_model
from k3post.scoring import sequence_logprobs, token_logprobs
from k3post.rewards.effort import BudgetTable, EffortConfig, TaskSamples, task_key
from k3post.loop import train_policy
from k3post.config.rl import RLConfig
from k3post.envs.families.streams import train_tasks
from k3post.stages.rl import rl_signal
from k3post.rollout.embedded import EmbeddedEngine
from k3post.rollout.evaluation import evaluate_episodes, run_episodes
from k3post.stages.sft import SFTConfig, train_sft
from k3post.synth.pipeline import synthesize
from k3post.xtml import XTML

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILY = "general.faithfulness"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            moe_intermediate_size=64, num_experts=4, intermediate_size=128)


# --------------------------------------------------------------------------- planted bugs
@pytest.fixture(scope="module")
def bug(request):
    """Plants ``--inject-bug`` in the library for this module's run (nothing when it is not given)."""
    name = request.config.getoption("inject_bug")
    with pytest.MonkeyPatch.context() as mp:
        if name == "loss_mask":
            import k3post.stages.sft as sft_mod

            collate = sft_mod.collate

            def inverted(samples, rows, max_len, pad_id):
                flipped = [Sample(s.ids, [False] + [not m for m in s.loss_mask[1:]], s.source) for s in samples]
                return collate(flipped, rows, max_len, pad_id)

            mp.setattr(sft_mod, "collate", inverted)
        elif name == "advantage_sign":
            import k3post.stages.rl as rl_mod

            advantages = rl_mod.group_advantages_from_groups

            def negated(rewards, **kw):
                a = advantages(rewards, **kw)
                return type(a)([[-x for x in g] for g in a.advantages], a.num_zero_variance, a.skip)

            mp.setattr(rl_mod, "group_advantages_from_groups", negated)
        elif name == "override_off":
            import k3post.stages.rl as rl_mod

            override = rl_mod.group_override

            def no_override(group, table, effort, cfg):
                _, m = override(group, table, effort, cfg)
                return torch.tensor(group.rewards, dtype=torch.float64), m

            mp.setattr(rl_mod, "group_override", no_override)
        elif name == "teacher_student":
            import k3post.stages.mopd as mopd_mod

            reward = mopd_mod.opd_reward
            mp.setattr(mopd_mod, "opd_reward", lambda teacher_BT, student_BT, *a, **kw: reward(student_BT, teacher_BT, *a, **kw))
        elif name is not None:
            raise pytest.UsageError(f"--inject-bug {name!r}: expected loss_mask, advantage_sign, override_off or teacher_student")
        yield name


# --------------------------------------------------------------------------- micro task and models
@pytest.fixture(scope="module")
def world(xtml_tokenizer):
    tok = xtml_tokenizer
    fam = get_family(FAMILY)
    return {
        "tok": tok, "xtml": XTML(tok), "fam": fam,
        "low": synthesize(fam, effort="low", n=300, seed=1),  # answer directly
        "max": synthesize(fam, effort="max", n=300, seed=2),  # reason over the context first (~100 tokens)
        "held_recs": synthesize(fam, effort="low", n=40, seed=98),
        "held": fam.generate(100, seed=99),
    }


def _samples(world, recs) -> list[Sample]:
    return [Sample(*render_record(world["xtml"], r), source=str(i)) for i, r in enumerate(recs)]


def _model(world, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    tok = world["tok"]
    return build_tiny_moe(len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=world["xtml"].eom_id, **TINY)


def _sft(world, recs, steps: int, tmp: Path, *, qat: bool = False) -> torch.nn.Module:
    model = _model(world)
    if qat:
        from k3post.quant.qat import QATConfig, apply_qat

        apply_qat(model, QATConfig())
    cfg = SFTConfig(steps=steps, lr=1e-2, pack_len=512, rows_per_batch=4, warmup_steps=10, progress=False,
                    log_every=10**6, save_every=10**6)
    train_sft(model, world["tok"], _samples(world, recs), cfg, tmp, resume=False)
    return model.eval()


def _heldout_loss(world, model) -> float:
    """Mean next-token loss over the assistant tokens of held-out reference conversations."""
    total = n = 0.0
    for s in _samples(world, world["held_recs"]):
        ids_1T = torch.tensor(s.ids)[None]
        with torch.no_grad():
            logp_1T, _ = token_logprobs(model.eval(), ids_1T, torch.ones_like(ids_1T))
        m_T = torch.tensor(s.loss_mask)
        total += float(-logp_1T[0][m_T].sum())
        n += int(m_T.sum())
    return total / n


def _pass_rate(world, model, tasks, *, effort="low", max_tokens=40, temperature=0.0, samples=1, seed=0) -> float:
    engine = EmbeddedEngine(model, world["tok"], max_batch_size=64)
    return evaluate_episodes(engine, world["xtml"], tasks, effort=effort, max_tokens=max_tokens, temperature=temperature,
                             samples=samples, seed=seed)["overall"]["pass_rate"]


def _rl_cfg(**kw) -> RLConfig:
    base = dict(domain="general", families=[FAMILY], steps=10, n_tasks=16, save_every=10**6, progress=False,
                effort="low", effort_control=EffortConfig(tau_low=100.0, max_cap=100.0),
                rollout={"n_prompts": 4, "k": 8, "lambda_": 1.0, "temperature": 0.7, "max_tokens": 40}, optim={"lr": 1e-3})
    return RLConfig().with_settings(base).with_settings(kw)


def _budgets(tasks, b0) -> BudgetTable:
    """b0 per task (a number for all, or task key -> b0)."""
    table = BudgetTable({"test": "learning"})
    table.add_samples({task_key(t): TaskSamples(t.family, [b0 if isinstance(b0, (int, float)) else b0[task_key(t)]], [True])
                       for t in tasks}, q=0.9, min_b0=1.0, floor=0.0)
    return table


def _train_rl(world, model, cfg, tasks, budgets, tmp):
    _, rows, _, loop = train_policy(model, world["tok"], cfg, tmp, tasks=tasks, signal=rl_signal(budgets, cfg))
    loop.close()
    return rows


@pytest.fixture(scope="module")
def sft_low(world, bug, tmp_path_factory):
    """(model before, model after 200 SFT steps on the low-effort traces)."""
    return _model(world).eval(), _sft(world, world["low"], 200, tmp_path_factory.mktemp("sft_low"))


# --------------------------------------------------------------------------- the checks
def test_sft_lowers_heldout_loss_and_raises_pass_rate(world, sft_low):
    """Measured: held-out loss 6.06 -> 0.34, pass rate 0 -> 0.39 (100 held-out tasks, greedy); with the loss
    mask inverted the loss rises to 6.72."""
    before, after = sft_low
    loss0, loss1 = _heldout_loss(world, before), _heldout_loss(world, after)
    assert loss1 < 0.25 * loss0, (loss0, loss1)
    p0, p1 = _pass_rate(world, before, world["held"]), _pass_rate(world, after, world["held"])
    assert p0 == 0.0 and p1 >= 0.2, (p0, p1)


def test_qat_sft_learns(world, bug, tmp_path):
    """The same SFT (150 steps) with MXFP4 / MXFP8 fake quantization of the experts from the first step.
    Measured: held-out loss 6.06 -> 0.38."""
    before = _model(world).eval()
    after = _sft(world, world["low"], 150, tmp_path, qat=True)
    loss0, loss1 = _heldout_loss(world, before), _heldout_loss(world, after)
    assert loss1 < 0.25 * loss0, (loss0, loss1)
    assert _pass_rate(world, after, world["held"]) >= 0.2


def test_rl_raises_reward(world, sft_low, tmp_path):
    """RL on 3 tasks the SFT model solves 30-60% of the time (sampled at temperature 0.7): the mean reward
    of 16 fresh samples per task rises and closes at least half of its gap to 1. Measured 0.66 -> 0.97 in 10
    steps (advantage sign flipped: -> 0); with the XTML segment tokenizer (issue 17) 0.75 -> 0.91."""
    model = copy.deepcopy(sft_low[1])
    pool = train_tasks([FAMILY], 48, difficulty=1, seed=0)
    engine = EmbeddedEngine(model, world["tok"], max_batch_size=64)
    per = run_episodes(engine, world["xtml"], pool, effort="low", max_tokens=40, temperature=0.7, samples=16, seed=5)
    rates = [sum(t.reward >= 1.0 for t in ts) / 16 for ts in per]
    tasks = [t for t, p in zip(pool, rates) if 0.05 <= p <= 0.6][:4]
    assert len(tasks) >= 2, rates

    def reward(m):
        return _pass_rate(world, m, tasks, temperature=0.7, samples=16, seed=77)

    r0 = reward(model)
    _train_rl(world, model, _rl_cfg(), tasks, _budgets(tasks, 40), tmp_path)
    r1 = reward(model)
    assert r1 >= r0 + 0.1 and r1 - r0 >= 0.5 * (1 - r0), (r0, r1)


def test_effort_override_shortens_thinking(world, bug, tmp_path):
    """A model SFT-ed at effort max thinks ~100 tokens (sampled, temperature 0.7); with b0 = each task's
    median and τ = 1 the override gives −1 to the longer half. Measured (150 SFT steps, 8 RL steps): mean
    thinking 99 -> 32 tokens; with the override off 99 -> 116, with the advantage sign flipped 99 -> 157."""
    model = _sft(world, world["max"], 150, tmp_path / "sft")
    tasks = train_tasks([FAMILY], 8, difficulty=1, seed=0)

    def thinking(seed):
        engine = EmbeddedEngine(model, world["tok"], max_batch_size=64)
        per = run_episodes(engine, world["xtml"], tasks, effort="max", max_tokens=160, temperature=0.7, samples=8, seed=seed)
        return [[t.thinking_tokens for t in ts] for ts in per]

    b0 = {task_key(t): statistics.median(lengths) for t, lengths in zip(tasks, thinking(5))}
    t0 = statistics.fmean(x for ts in thinking(77) for x in ts)
    cfg = _rl_cfg(effort="max", rollout={"max_tokens": 160}, steps=8, effort_control=EffortConfig(tau_max=1.0, max_cap=1.0))
    _train_rl(world, model, cfg, tasks, _budgets(tasks, b0), tmp_path / "rl")
    t1 = statistics.fmean(x for ts in thinking(77) for x in ts)
    assert t0 > 80 and t1 <= 0.7 * t0, (t0, t1)


@pytest.mark.parametrize("seed", [0, 1])
def test_mopd_lowers_reverse_kl(world, sft_low, tmp_path, seed):
    """Teacher: the 200-step SFT model (expert general.low). Student: the teacher with Gaussian noise on every
    weight (0.5 of each tensor's std, noise and run seeded by ``seed``), so it disagrees with the teacher from
    the start. The reverse KL E_student[log π_s − log π_t] per sampled token, on 8 samples of each of 12 prompts
    at temperature 1, falls to at most 0.3 of its start within 24 steps, for each of 2 seeds.

    Margin (docs/decisions.md, issue 30 §0 and its follow-up): at 24 steps, lr 1e-3, the final / initial ratio
    over seeds 0-5 on an AMD EPYC was 0.04-0.09, the per-step estimate settled at 0.02-0.04 (its sampling floor),
    so 0.3 is 3.3× the worst run. At 12 steps (the old length) the end point was a noisy walk, not a converged
    value: there, seed 0's student (0.44 at the start) first climbs to 0.78 on step 11, then falls to 0.05 by step
    18 (ratio 1.93 at 12 steps, 0.07 at 24, 0.05 at 30), which failed the old 0.75 bound on that machine.
    Teacher and student swapped: 0.29 -> 8.65 (ratio 30), fails."""
    from k3post.config.mopd import MOPDConfig
    from k3post.stages.mopd import train_mopd

    teacher = sft_low[1]
    teacher_dir = save_model(teacher, tmp_path / "teacher", world["tok"])
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp_min(1e-3))
    probe = train_tasks([FAMILY], 12, difficulty=1, seed=3)

    def reverse_kl() -> float:
        engine = EmbeddedEngine(student, world["tok"], max_batch_size=64)
        trajs = [t for ts in run_episodes(engine, world["xtml"], probe, effort="low", max_tokens=40, temperature=1.0,
                                          samples=8, seed=11) for t in ts]
        teacher_lp = sequence_logprobs(teacher.eval(), [t.token_ids for t in trajs], 4096)
        gaps = [s - q for t, row in zip(trajs, teacher_lp) for s, q, m in zip(t.logprobs, row, t.trainable) if m]
        return statistics.fmean(gaps)

    kl0 = reverse_kl()
    cfg = MOPDConfig(experts={"general.low": str(teacher_dir)}, effort_mix={"low": 1.0}, domains=["general"],
                     families={"general": [FAMILY]}, rl=_rl_cfg(steps=24, rollout={"k": 4, "temperature": 1.0}, seed=seed))
    train_mopd(student, world["tok"], cfg, tmp_path / "mopd")
    kl1 = reverse_kl()
    assert kl0 > 0.05 and kl1 <= 0.3 * kl0, (kl0, kl1)  # kl0 measured 0.12-0.62
