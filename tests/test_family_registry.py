"""The task-family registry as a plugin loader: the built-in families are declared once
(`registry.BUILTIN_MODULES`), imported by name on the first question, and a broken family module is either an
error or, when asked (`skip_broken`), a note while the others load.

Shape legend: none.
"""

from __future__ import annotations

import importlib

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
