"""The registry of built-in task families, by domain.

A family bundles a seeded generator, an environment factory, a reference solver that writes complete
trajectories at every effort level, a verifier (registered in k3post.envs.task under the family's name)
and a set of wrong or hacky policies that must all score 0.

    fam = get_family("coding.write_function")
    tasks = fam.generate(100, seed=0, difficulty=1)
    env = fam.make_env(tasks[0])
    ep = run_episode_sync(fam.reference_policy(tasks[0], "max"), env, tasks[0])

Adding a built-in family: a folder ``k3post/envs/families/<name>/`` with an ``__init__.py`` and a ``family.py``
that defines the family (`common.FamilyBase` does the plumbing; `k3post.envs.sandbox_tools` is the kit of a family
whose agent edits files in a sandbox), registers its verifier (`k3post.envs.task.register_verifier`) and ends with
``register_family(MyFamily())``; then ``<name>`` in `BUILTIN_MODULES`. The registry imports no family itself.

Families from outside the package (plugins, docs/extending.md) are modules that register families the same way,
found on the first question after the built-ins: those of installed distributions, through the entry-point group
``k3post.families`` (``[project.entry-points."k3post.families"] my_tasks = "my_tasks.family"``), and those named in
the environment variable ``K3POST_FAMILIES`` (comma-separated module names on the import path). A plugin family is
opt-in, as the `OPT_IN_KINDS` are: it is used where it is named (``data.family_tasks``, ``rl.families``, ``k3post
synth --families``), never by default, so installing one leaves every default run as it was.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Any, Protocol, runtime_checkable

from k3post.constants import Policy
from k3post.envs.env import Environment
from k3post.envs.task import DOMAINS, Task



@runtime_checkable
class TaskFamily(Protocol):
    """What every built-in family provides."""

    name: str  # "<domain>.<family>", also the verifier name
    domain: str  # one of DOMAINS
    description: str
    verifiable: bool  # False: rewarded by a judge (the GRM), not a rule

    def generate(self, n: int, *, seed: int, difficulty: int = 1) -> list[Task]:
        """`n` distinct tasks, a pure function of (seed, difficulty)."""
        ...

    def make_env(self, task: Task) -> Environment:
        """A fresh environment for one episode of `task`."""
        ...

    def reference_policy(self, task: Task, effort: str) -> Policy:
        """A scripted solver: thorough reasoning at `max`, terse at `low`, honest token counts."""
        ...

    def wrong_policies(self, task: Task) -> dict[str, Policy]:
        """Named wrong / hacky policies (empty answer, copied prompt, claims without the work ...)."""
        ...


_FAMILIES: dict[str, TaskFamily] = {}

BUILTIN_MODULES: tuple[str, ...] = ("general", "agents", "coding", "aet", "workflows", "research", "kernel", "visual", "webdev")
"""The built-in families, declared here and nowhere else: one folder each under ``k3post/envs/families/``, whose
``family.py`` registers them when imported (`register_family` at its end). The registry imports none of them at import time (it sits at the
bottom: the families import it); the first question about the registered families (`get_family`, `families`, ...)
imports each by name (`load_builtin`)."""

OPT_IN_KINDS = ("aet", "workflow", "research", "kernel", "visual", "webdev")
"""Family ``kind`` values left out of `default_families`: AET, professional workflows and deep research (issue 21),
kernel optimisation, visual reasoning and web development (issue 22)."""

PLUGIN_GROUP = "k3post.families"
"""Entry-point group of installed plugin families: each entry point names a module that registers families."""

PLUGIN_ENV = "K3POST_FAMILIES"
"""Environment variable: comma-separated modules (on the import path) that register plugin families."""

_loaded = False
_PLUGIN_FAMILIES: dict[str, str] = {}  # family name -> the plugin (entry point or module) that registered it


def register_family(family: TaskFamily) -> TaskFamily:
    """Add a family; its name must be `<domain>.<name>` with a known domain and unique."""
    if not isinstance(family, TaskFamily):
        raise ValueError(f"{family!r} does not implement the TaskFamily protocol")
    domain = family.name.split(".", 1)[0]
    if domain not in DOMAINS or family.domain != domain:
        raise ValueError(f"family '{family.name}': name must start with its domain, one of {DOMAINS}")
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"family '{family.name}' is already registered")
    _FAMILIES[family.name] = family
    return family


def builtin_module(name: str) -> str:
    """The dotted module that registers the built-in families of the folder ``name`` (one of `BUILTIN_MODULES`)."""
    if name not in BUILTIN_MODULES:
        raise ValueError(f"unknown built-in family module {name!r}; expected one of {BUILTIN_MODULES}")
    return f"k3post.envs.families.{name}.family"


def plugin_sources() -> list[tuple[str, str]]:
    """The plugin modules to load, as (where it was declared, module name): the ``k3post.families`` entry points of
    the installed distributions (in name order), then the modules of ``K3POST_FAMILIES`` in the order given."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed distribution"
        out.append((f"entry point {ep.name!r} = {ep.value!r} of {dist} (group {PLUGIN_GROUP})", ep.value))
    for name in (n.strip() for n in os.environ.get(PLUGIN_ENV, "").split(",")):
        if name:
            out.append((f"{PLUGIN_ENV}={os.environ[PLUGIN_ENV]!r}", name))
    return out


def _import_plugin(where: str, target: str) -> None:
    """Import one plugin: a module (``pkg.mod``) whose import registers families, or an object (``pkg.mod:obj``) that
    is a family, registered here. Families it registers are recorded as plugin families (opt-in)."""
    module, _, attr = target.partition(":")
    before = set(_FAMILIES)
    try:
        obj: Any = importlib.import_module(module.strip())
        for part in filter(None, attr.strip().split(".")):
            obj = getattr(obj, part)
    except Exception as e:
        raise ImportError(f"task family plugin {target!r} ({where}) cannot be loaded: {type(e).__name__}: {e}") from e
    if attr and isinstance(obj, TaskFamily) and obj.name not in _FAMILIES:
        register_family(obj)
    new = sorted(set(_FAMILIES) - before)
    if not new:  # imported before the registry asked (its families registered then): those its module defines
        new = sorted(n for n, f in _FAMILIES.items() if type(f).__module__ == module.strip()
                     or (attr and f is obj))
    if not new:
        raise ValueError(f"task family plugin {target!r} ({where}) registered no family: its module must call "
                         "register_family(...) (or the entry point name a TaskFamily object)")
    for name in new:
        _PLUGIN_FAMILIES[name] = target


def load_builtin(*, skip_broken: bool = False) -> list[str]:
    """Import every module of `BUILTIN_MODULES`, then every plugin (`plugin_sources`), once; importing registers
    their families. A module that fails to import raises, unless ``skip_broken``: then it is skipped and the
    returned notes say which and why (the families of the others are registered; the next call tries the failed
    ones again)."""
    global _loaded
    if _loaded:
        return []
    notes: list[str] = []
    for name in BUILTIN_MODULES:
        try:
            importlib.import_module(builtin_module(name))
        except Exception as e:  # noqa: BLE001 - with skip_broken, any failure of a family module is noted, not fatal
            if not skip_broken:
                raise
            notes.append(f"{builtin_module(name)} cannot be imported: {type(e).__name__}: {e}")
    for where, target in plugin_sources():
        if target in _PLUGIN_FAMILIES.values():
            continue  # loaded by an earlier call
        try:
            _import_plugin(where, target)
        except Exception as e:  # noqa: BLE001 - as for the built-ins
            if not skip_broken:
                raise
            notes.append(str(e))
    _loaded = not notes
    return notes


def plugin_families() -> dict[str, str]:
    """The registered plugin families: name -> the plugin module that registered it."""
    load_builtin()
    return dict(_PLUGIN_FAMILIES)


def get_family(name: str) -> TaskFamily:
    """The registered family ``name``; ValueError (with the closest known name) for an unknown one."""
    load_builtin()
    if name not in _FAMILIES:
        import difflib

        close = difflib.get_close_matches(name, list(_FAMILIES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"unknown task family '{name}'{hint}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def local_env(task: Task) -> Environment:
    """A fresh environment for ``task`` from its registered family, in this process (the rollout's `make_env`
    places it elsewhere: `k3post.rollout.evaluation.env_placement`)."""
    return get_family(task.family).make_env(task)


def families(domain: str | None = None) -> list[TaskFamily]:
    """All registered families, optionally of one domain, sorted by name."""
    load_builtin()
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"unknown domain '{domain}'; expected one of {DOMAINS}")
    return [f for n, f in sorted(_FAMILIES.items()) if domain is None or f.domain == domain]


def default_families(domain: str | None = None) -> list[TaskFamily]:
    """``families(domain)`` without the opt-in kinds: what the demo's tokenizer corpus, SFT mix and draft data use
    when no list is given. Plugin families (`plugin_families`) and the families of the `OPT_IN_KINDS` are opt-in: the verify-in-the-loop (AET) ones run
    sandboxed verifiers, the kernel family compiles and times code, the visual one carries images, the web one drives a
    browser, and they all came after the demo's and the
    full recipe's numbers were measured."""
    return [f for f in families(domain) if getattr(f, "kind", "") not in OPT_IN_KINDS and f.name not in _PLUGIN_FAMILIES]


def lexicon(domain: str | None = None) -> list[str]:
    """The words of every default family's ``lexicon()`` (`default_families`; those of ``domain`` only, if
    given), each once, in family-name order: what `k3post.tokenizer.lexicon_corpus` makes into few-token
    names. The opt-in kinds stay out so that registering them leaves the demo's tokenizer as measured."""
    words: dict[str, None] = {}
    for f in default_families(domain):
        words.update(dict.fromkeys(getattr(f, "lexicon", lambda: ())()))
    return list(words)
