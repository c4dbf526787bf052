"""SFT data synthesis (SPEC §2): teachers, multi-stage verification, human review, mixing.

* `k3post.synth.teachers` - `ReferenceTeacher`, `EndpointTeacher`, `LocalModelTeacher`
* `k3post.synth.pipeline` - `synthesize`, `build_sft_dataset`, the sample format, `SynthConfig`
* `k3post.synth.verify`   - the stages (structure, outcome, quality, judge), `Funnel`, `Judge`
* `k3post.synth.review`   - `ReviewQueue` (on disk, file-locked, append-only decision log)
* `k3post.synth.mix`      - weighted domain / effort mixing
* `k3post.synth.cli`      - ``k3post synth``, ``k3post review``, ``k3post mix``
"""

from __future__ import annotations

import importlib
from typing import Any

# the light mixing module eagerly (its function `mix` shadows the submodule name, as before); the rest on
# first use, so that building the `k3post` parser (k3post.synth.cli) imports neither torch nor transformers
from k3post.synth.mix import MixConfig, load_mix_config, mix, mix_files

_EXPORTS: dict[str, str] = {
    "SynthConfig": "k3post.synth.pipeline",
    "build_sft_dataset": "k3post.synth.pipeline",
    "builtin_families": "k3post.synth.pipeline",
    "count_sample_tokens": "k3post.synth.pipeline",
    "find_family": "k3post.synth.pipeline",
    "read_jsonl": "k3post.io",
    "replay_sample": "k3post.synth.pipeline",
    "sft_record": "k3post.synth.pipeline",
    "synth_from_config": "k3post.synth.pipeline",
    "synthesize": "k3post.synth.pipeline",
    "verify_and_route": "k3post.synth.pipeline",
    "ReviewQueue": "k3post.synth.review",
    "reverify": "k3post.synth.review",
    "EndpointTeacher": "k3post.synth.teachers",
    "LocalModelTeacher": "k3post.synth.teachers",
    "ReferenceTeacher": "k3post.synth.teachers",
    "RetryTransport": "k3post.httpclient",
    "SamplingParams": "k3post.synth.teachers",
    "Teacher": "k3post.synth.teachers",
    "STAGES": "k3post.synth.verify",
    "Funnel": "k3post.synth.verify",
    "Judge": "k3post.synth.verify",
    "JudgeResult": "k3post.synth.verify",
    "StageResult": "k3post.synth.verify",
    "VerifyConfig": "k3post.synth.verify",
    "VerifyContext": "k3post.synth.verify",
    "VerifyReport": "k3post.synth.verify",
    "WritingRuleJudge": "k3post.synth.verify",
    "judge_stage": "k3post.synth.verify",
    "outcome_stage": "k3post.synth.verify",
    "quality_stage": "k3post.synth.verify",
    "structure_stage": "k3post.synth.verify",
    "verify_samples": "k3post.synth.verify",
}

__all__ = [
    "STAGES",
    "EndpointTeacher",
    "Funnel",
    "Judge",
    "JudgeResult",
    "LocalModelTeacher",
    "MixConfig",
    "ReferenceTeacher",
    "RetryTransport",
    "ReviewQueue",
    "SamplingParams",
    "StageResult",
    "SynthConfig",
    "Teacher",
    "VerifyConfig",
    "VerifyContext",
    "VerifyReport",
    "WritingRuleJudge",
    "build_sft_dataset",
    "builtin_families",
    "count_sample_tokens",
    "find_family",
    "judge_stage",
    "load_mix_config",
    "mix",
    "mix_files",
    "outcome_stage",
    "quality_stage",
    "read_jsonl",
    "replay_sample",
    "reverify",
    "sft_record",
    "structure_stage",
    "synth_from_config",
    "synthesize",
    "verify_and_route",
    "verify_samples",
]


def __getattr__(name: str) -> Any:
    """Import on first use (see `_EXPORTS`)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'k3post.synth' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
