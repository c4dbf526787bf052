"""SFT data synthesis (SPEC §2): teachers, multi-stage verification, human review, mixing.

* `k3post.synth.teachers` - `ReferenceTeacher`, `EndpointTeacher`, `LocalModelTeacher`
* `k3post.synth.pipeline` - `synthesize`, `build_sft_dataset`, the sample format, `SynthConfig`
* `k3post.synth.verify`   - the stages (structure, outcome, quality, judge), `Funnel`, `Judge`
* `k3post.synth.review`   - `ReviewQueue` (on disk, file-locked, append-only decision log)
* `k3post.synth.mix`      - weighted domain / effort mixing
* `k3post.synth.cli`      - ``k3post synth``, ``k3post review``, ``k3post mix``
"""

from k3post.synth.mix import MixConfig, load_mix_config, mix, mix_files
from k3post.synth.pipeline import (
    SynthConfig,
    build_sft_dataset,
    builtin_families,
    count_sample_tokens,
    find_family,
    read_jsonl,
    replay_sample,
    sft_record,
    synth_from_config,
    synthesize,
    verify_and_route,
)
from k3post.synth.review import ReviewQueue, reverify
from k3post.synth.teachers import EndpointTeacher, LocalModelTeacher, ReferenceTeacher, RetryTransport, SamplingParams, Teacher
from k3post.synth.verify import (
    STAGES,
    Funnel,
    Judge,
    JudgeResult,
    StageResult,
    VerifyConfig,
    VerifyContext,
    VerifyReport,
    WritingRuleJudge,
    judge_stage,
    outcome_stage,
    quality_stage,
    structure_stage,
    verify_samples,
)

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
