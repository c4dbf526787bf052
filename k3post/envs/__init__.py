"""Environments, harness, sandbox and task families.

The API task families build on (re-exported here):

* tools   - `ToolSpec`, `ToolContext`, `call_tool` (k3post.envs.tools)
* tasks   - `Task`, `Verdict`, `FinalState`, `register_verifier`, `get_verifier` (k3post.envs.task)
* envs    - `Environment`, `ToolEnvironment`, `EpisodeLimits`, `StepResult` (k3post.envs.env)
* running - `run_episode`, `resume_episode`, `EpisodeRunner`, `Episode`, `OpenAIPolicy`, `GymEnv`
            (k3post.envs.episode)
* harness - `Harness`, `HarnessConfig`, `HarnessSampler`, `HarnessSpace` (k3post.envs.harness)

The sandbox lives in `k3post.envs.sandbox` and is not imported here (it is heavier).
"""

from k3post.envs.env import Environment, EpisodeLimits, StepResult, ToolEnvironment, count_tokens
from k3post.envs.episode import (
    Episode,
    EpisodeRunner,
    GymEnv,
    OpenAIPolicy,
    Policy,
    call_policy,
    offered_tools,
    resume_episode,
    resume_episode_sync,
    run_episode,
    run_episode_sync,
)
from k3post.envs.harness import (
    ContextConfig,
    Harness,
    HarnessConfig,
    HarnessSampler,
    HarnessSpace,
    MemoryConfig,
    MemoryStore,
    SkillConfig,
    SkillsConfig,
    SubagentConfig,
    SystemPromptConfig,
    ToolInterfaceConfig,
)
from k3post.envs.task import DOMAINS, FinalState, Task, Verdict, get_verifier, register_verifier, verifier_names
from k3post.envs.tools import ToolContext, ToolSpec, call_tool

__all__ = [
    "DOMAINS",
    "ContextConfig",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "EpisodeRunner",
    "FinalState",
    "GymEnv",
    "Harness",
    "HarnessConfig",
    "HarnessSampler",
    "HarnessSpace",
    "MemoryConfig",
    "MemoryStore",
    "OpenAIPolicy",
    "Policy",
    "SkillConfig",
    "SkillsConfig",
    "StepResult",
    "SubagentConfig",
    "SystemPromptConfig",
    "Task",
    "ToolContext",
    "ToolEnvironment",
    "ToolInterfaceConfig",
    "ToolSpec",
    "Verdict",
    "call_policy",
    "call_tool",
    "count_tokens",
    "get_verifier",
    "offered_tools",
    "register_verifier",
    "resume_episode",
    "resume_episode_sync",
    "run_episode",
    "run_episode_sync",
    "verifier_names",
]
