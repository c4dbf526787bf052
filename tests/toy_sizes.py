"""Toy sizes for end-to-end runs in tests: dotted overrides that shrink every stage of `k3post demo` (and the
stage commands, which read the same config tree) to a step or two, keeping what each stage does."""

from __future__ import annotations

# SFT data and the SFT stage
TOY_SFT = [
    "demo.base=none", "data.n_train=60", "data.n_per_family=1", "data.family_tasks.coding.write_function=1", "data.family_tasks.agents.search=1",
    "data.n_eval=8", "data.corpus_per_family=1", "sft.steps=6", "sft.save_every=3", "sft.rows_per_batch=1",
    "sft.max_len=4096", "sft.progress=false", "eval.max_new_tokens=24", "eval.efforts=[max,low]",
]

# Stage 2 / 3 at toy size: 2 efforts per domain, a step or two each; the EAGLE-3 drafts (LK_alpha and KL)
TOY_STAGES = [
    "rl.steps=2", "rl.rollout.n_prompts=2", "rl.rollout.k=4", "rl.n_tasks=4", "rl.eval_n=4", "rl.rollout.max_tokens=24", "rl.eval_max_tokens=24",
    "rl.effort_control.curriculum=[max,low]", "rl.effort_control.b0_samples=2", "rl.progress=false",
    *(f"{sec}.domain_overrides.{d}.{k}={v}" for sec in ("rl", "mopd.rl") for d in ("agents", "coding")
      for k, v in (("steps", 1), ("rollout.n_prompts", 1), ("n_tasks", 2), ("eval_n", 2), ("rollout.max_tokens", 24),
                   ("eval_max_tokens", 24))),
    # general at the sizes above, also where a recipe sizes the domain itself (configs/full.yaml)
    *(f"{sec}.domain_overrides.general.{k}={v}" for sec in ("rl", "mopd.rl")
      for k, v in (("n_tasks", 4), ("eval_n", 4), ("rollout.max_tokens", 24), ("eval_max_tokens", 24))),
    # general.max's own batch (the demo's 32 prompts and avg@8) at the toy size
    *(f"{sec}.domain_overrides.general.max.{k}={v}" for sec in ("rl", "mopd.rl") for k, v in (("rollout.n_prompts", 2), ("eval_samples", 2))),
    "mopd.rl.steps=2", "mopd.rl.rollout.n_prompts=3", "mopd.rl.rollout.k=2", "mopd.rl.n_tasks=2", "mopd.rl.eval_n=2",
    "mopd.rl.rollout.max_tokens=24", "mopd.rl.eval_max_tokens=24", "mopd.rl.progress=false", "mopd.effort_mix.high=0",
    "draft.families=[general.arithmetic]", "draft.efforts=[low]", "draft.n_per_family=10", "draft.max_tokens=16",
    "draft.steps=2", "draft.batch_size=2", "draft.ttt_steps=2", "draft.save_every=1", "draft.log_every=1",
    "draft.progress=false",
]

# the demo's own tokenizer, trained on the toy data (a user's model folder brings its own)
TOY_TOKENIZER = ["tokenizer.vocab_size=400"]

TOY_DEMO = [*TOY_SFT, *TOY_TOKENIZER, *TOY_STAGES]
