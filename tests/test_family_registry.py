"""The task-family registry as a plugin loader: the built-in families are declared once
(`registry.BUILTIN_MODULES`), imported by name on the first question, and a broken family module is either an
error or, when asked (`skip_broken`), a note while the others load.

Shape legend: none.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from k3post.envs.families import registry


def test_builtin_modules_register_every_family_and_only_theirs() -> None:
    fams = registry.families()
    modules = {registry.builtin_module(m) for m in registry.BUILTIN_MODULES}
    by_module: dict[str, set[str]] = {}
    for f in fams:
        by_module.setdefault(type(f).__module__, set()).add(f.name)
    # every registered family is defined by a module of the declared list, and every listed module defines some
    assert set(by_module) == modules
    assert len(fams) == sum(len(v) for v in by_module.values()) == 16
    for m in registry.BUILTIN_MODULES:
        assert importlib.import_module(registry.builtin_module(m)) is not None


def test_unknown_builtin_module_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown built-in family module 'nope'"):
        registry.builtin_module("nope")


def test_a_broken_family_module_raises_or_is_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "BUILTIN_MODULES", (*registry.BUILTIN_MODULES, "no_such_family"))
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(ModuleNotFoundError, match="no_such_family"):
        registry.load_builtin()
    notes = registry.load_builtin(skip_broken=True)
    assert len(notes) == 1 and "k3post.envs.families.no_such_family.family cannot be imported" in notes[0]
    assert registry._loaded is False  # the next call tries again
    assert "general.arithmetic" in registry._FAMILIES and "coding.webdev" in registry._FAMILIES


def test_get_family_names_the_closest_known_family() -> None:
    with pytest.raises(ValueError, match=r"unknown task family 'coding.bugfx' \(did you mean 'coding.bugfix'\?\)"):
        registry.get_family("coding.bugfx")


# --------------------------------------------------------------------------- plugins (issue 33, docs/extending.md)

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"

LAX = '''
from reverse_words import ReverseWordsFamily
from k3post.envs.families.common import submission_text
from k3post.envs.families.registry import register_family
from k3post.envs.task import Verdict, register_verifier


class LaxFamily(ReverseWordsFamily):
    name = "general.reverse_words_lax"


@register_verifier("general.reverse_words_lax")
def lax(task, final):  # a planted bug: any part of the answer passes, the empty one included
    got = " ".join(submission_text(final.submission).lower().split())
    return Verdict(float(got in task.metadata["answer"]), {}, "")


register_family(LaxFamily())
'''


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The registry and verifier tables as they are, restored afterwards; the plugins' modules forgotten."""
    from k3post.envs import task as task_mod

    registry.load_builtin()
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_PLUGIN_FAMILIES", {})
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(task_mod, "_VERIFIERS", dict(task_mod._VERIFIERS))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name in ("reverse_words", "lax_words", "empty_plugin", "ep_words"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv(registry.PLUGIN_ENV, raising=False)
    return monkeypatch


def test_a_plugin_named_in_the_environment_is_registered_opt_in(fresh_registry: Any) -> None:
    """``K3POST_FAMILIES`` modules load after the built-ins; their families answer `get_family` and list as plugins
    but stay out of `default_families` (the demo's data and corpus do not change when one is installed)."""
    fresh_registry.setenv(registry.PLUGIN_ENV, " reverse_words , ")
    fam = registry.get_family("general.reverse_words")
    assert registry.plugin_families() == {"general.reverse_words": "reverse_words"}
    assert fam in registry.families("general")
    assert fam not in registry.default_families()
    assert registry.default_families() == [f for f in registry.families()
                                           if f is not fam and getattr(f, "kind", "") not in registry.OPT_IN_KINDS]
    from k3post.envs.families.cli import list_text

    assert "general.reverse_words" in list_text("general") and "[plugin reverse_words, opt-in]" in list_text("general")


def test_an_installed_distribution_registers_its_families_through_an_entry_point(fresh_registry: Any,
                                                                                  tmp_path: Path) -> None:
    """The entry-point group ``k3post.families`` of an installed distribution (a dist-info folder on the path, as
    pip leaves it) names the module; importing it registers the family."""
    (tmp_path / "ep_words.py").write_text((EXAMPLES / "reverse_words.py").read_text())
    info = tmp_path / "ep_words-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-words\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[k3post.families]\nwords = ep_words\n")
    fresh_registry.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    sources = registry.plugin_sources()
    assert any(target == "ep_words" and "ep-words" in where for where, target in sources)
    assert registry.plugin_families() == {"general.reverse_words": "ep_words"}


def test_a_broken_or_empty_plugin_is_an_error_naming_it(fresh_registry: Any, tmp_path: Path) -> None:
    (tmp_path / "empty_plugin.py").write_text("X = 1\n")
    fresh_registry.syspath_prepend(str(tmp_path))
    fresh_registry.setenv(registry.PLUGIN_ENV, "no_such_plugin_module")
    with pytest.raises(ImportError, match=r"plugin 'no_such_plugin_module' \(K3POST_FAMILIES="):
        registry.load_builtin()
    notes = registry.load_builtin(skip_broken=True)
    assert len(notes) == 1 and "no_such_plugin_module" in notes[0] and registry._loaded is False
    assert "general.arithmetic" in registry._FAMILIES  # the built-ins are there all the same
    fresh_registry.setenv(registry.PLUGIN_ENV, "empty_plugin")
    with pytest.raises(ValueError, match="'empty_plugin' .* registered no family"):
        registry.load_builtin()


def test_tasks_check_passes_the_example_and_catches_a_hack_that_pays(fresh_registry: Any, tmp_path: Path) -> None:
    """`k3post tasks check`: the docs' example family passes every gate; the same family with a verifier that takes
    any part of the answer fails, naming the wrong policies it paid (the empty answer among them)."""
    from k3post.envs.families.cli import check_family

    (tmp_path / "lax_words.py").write_text(LAX)
    fresh_registry.syspath_prepend(str(tmp_path))
    fresh_registry.setenv(registry.PLUGIN_ENV, "reverse_words,lax_words")
    ok, text = check_family("general.reverse_words", n=4)
    assert ok, text
    assert "ok: every gate passed" in text
    ok, text = check_family("general.reverse_words_lax", n=4)
    assert not ok
    assert "wrong policy 'empty': reward 1.0, expected 0 (a hack that pays)" in text


def test_recipe_sft_data_uses_a_plugin_family_where_data_family_tasks_names_it(fresh_registry: Any, tmp_path: Path,
                                                                               xtml_tokenizer: Any) -> None:
    """Opt-in families join the SFT data when `data.family_tasks` names them (before, a named opt-in family was
    validated and then silently left out)."""
    import json

    from k3post.config import load_config
    from k3post.stages.sft_data import synthesize_sft_data

    fresh_registry.setenv(registry.PLUGIN_ENV, "reverse_words")
    cfg = load_config(None, ["data.n_train=2", "data.n_per_family=0", "data.family_tasks.coding.write_function=0",
                             "data.family_tasks.agents.search=0", "data.family_tasks.general.reverse_words=3",
                             "data.efforts=[low, max]", "data.effort_mix={}", "data.judge_tasks=0"])
    path = synthesize_sft_data(cfg, tmp_path, xtml_tokenizer)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(r["family"] == "general.reverse_words" for r in recs) == 6  # 3 tasks x 2 efforts
