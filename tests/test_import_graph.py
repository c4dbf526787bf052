"""The import graph of k3post (`bench/import_graph.py`: imports inside functions count) stays free of new circles.

`ALLOWED_CIRCLES` is empty since issue 33 §circles took the last five apart (`k3post.rollout.model_drafter`,
`k3post.stages.sft_data`, `k3post.synth.samples`, `k3post.serve.server`, the harness handed its sub-agent runner): the
test fails when any circle appears. The task families, their registry, the sandbox tool kit and `k3post.io`
were freed by issue 33 §plugins and must stay out of every circle.

Shape legend: none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench_module import load_bench

graph_mod = load_bench("import_graph")

ALLOWED_CIRCLES: set[frozenset[str]] = set()  # issue 33 took the last five apart: none may come back

#: modules issue 33 §plugins took out of the 24-module knot: in no circle, whatever the list above says
FREED_PREFIXES = ("k3post.envs.families", "k3post.envs.sandbox_tools", "k3post.io", "k3post.config", "k3post.data",
                  "k3post.rewards.grm", "k3post.rollout.evaluation", "k3post.synth.mix", "k3post.synth.teachers")


@pytest.fixture(scope="module")
def graph() -> Any:
    return graph_mod.import_graph()


def test_the_circles_left_are_exactly_the_allowed_ones(graph: Any) -> None:
    circles = {frozenset(c) for c in graph.circles()}
    new = circles - ALLOWED_CIRCLES
    gone = ALLOWED_CIRCLES - circles
    assert not new, f"import circles not in ALLOWED_CIRCLES (break them, do not list them): {[sorted(c) for c in new]}"
    assert not gone, f"listed circles that no longer exist: take them off ALLOWED_CIRCLES: {[sorted(c) for c in gone]}"


def test_the_freed_modules_are_in_no_circle(graph: Any) -> None:
    in_circles = {m for c in graph.circles() for m in c}
    assert not [m for m in in_circles if m.startswith(FREED_PREFIXES)]


def test_the_registry_and_io_sit_at_the_bottom(graph: Any) -> None:
    g = graph
    # the registry imports no family (it imports them by name on first use: registry.BUILTIN_MODULES)
    assert not [m for m in g.edges["k3post.envs.families.registry"] if m.startswith("k3post.envs.families.")]
    assert g.edges["k3post.io"] == set()  # the standard library only


def test_the_trainer_knows_no_algorithm(graph: Any) -> None:
    """Issue 33 §trainer: `k3post.trainer` (local, fsdp, ranks) imports no stage and no loss; each stage hands
    its step a gradient function (`k3post.trainer.local.Grads`)."""
    trainer = [m for m in graph.modules if m == "k3post.trainer" or m.startswith("k3post.trainer.")]
    assert {"k3post.trainer.local", "k3post.trainer.fsdp", "k3post.trainer.ranks"} <= set(trainer)
    algorithmic = ("k3post.stages.sft", "k3post.policy_step", "k3post.loop", "k3post.stages.rl", "k3post.stages.mopd", "k3post.spec",
                   "k3post.algos", "k3post.stages.pretrain")
    bad = {m: sorted(e for e in graph.edges[m] if e.startswith(algorithmic)) for m in trainer}
    assert not any(bad.values()), bad


def test_group_rewards_are_a_family_hook_and_the_rl_stage_holds_no_judge(graph: Any) -> None:
    """Issue 33 §judge: no task family imports a reward module (a family declares what a judge scores,
    `FamilyBase.grm_candidate`; the judging and its backend live in `k3post.rewards`), and the RL stage imports no GRM
    or gate code: it trains with the scorer `k3post.rewards.judge` builds."""
    families = [m for m in graph.modules if m.startswith("k3post.envs.families")]
    assert not {m: sorted(e for e in graph.edges[m] if e.startswith("k3post.rewards")) for m in families
                if any(e.startswith("k3post.rewards") for e in graph.edges[m])}
    rl = graph.edges["k3post.stages.rl"]
    assert not [e for e in rl if e.startswith(("k3post.rewards.grm", "k3post.rewards.judging"))], sorted(rl)
    assert "k3post.rewards.judge" in rl


#: modules over 800 lines (issue 33's measure: at most 3), each with why it stays long; a module that grows past 800
#: is split, or added here with its reason
LONG_MODULES_ALLOWED = {
    "k3post.envs.families.webdev.specs": "the web-app kinds' specs: HTML, JS and CSS templates with their checks",
    "k3post.rollout.http_engine": "the HTTP engine client: routing, retries, dead-server handling, pause / resume",
    "k3post.distributed.weight_sync": "the weight-sync transports: in-process, disk, gloo / NCCL, CUDA IPC",
}


def test_no_new_module_over_800_lines(graph: Any) -> None:
    """Issue 33 took the long modules from 10 to 3 (the sandbox, serve.app and the embedded engine were split in its
    twenty-fourth session): none may come back over 800 lines unlisted."""
    long = dict(graph.long_modules(800))
    assert set(long) <= set(LONG_MODULES_ALLOWED), f"over 800 lines, split them: {sorted(set(long) - set(LONG_MODULES_ALLOWED))}"
    assert len(LONG_MODULES_ALLOWED) <= 3

def test_the_graph_sees_function_level_imports_and_leaves_type_checking_out(tmp_path: Path) -> None:
    """On a small package: a circle closed only by an import inside a function is found, relative imports
    resolve, a ``TYPE_CHECKING`` import is no edge, and a module over the line limit is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n" + "x = 1\n" * 12)
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    g = graph_mod.import_graph(pkg)
    assert g.circles() == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert g.edges["pkg.d"] == set()
    assert sum(g.function_imports.values()) == 1 and g.function_imports["pkg.sub.b"] == 1
    assert g.long_modules(10) == [("pkg.sub.c", 13)]
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")  # the function-level import gone: no circle
    assert graph_mod.import_graph(pkg).circles() == []


def test_the_script_prints_its_numbers_as_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`python bench/import_graph.py --json` (docs/decisions.md, issue 33 §plugins): the last line is the numbers."""
    assert graph_mod.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {frozenset(c) for c in out["circles"]} == ALLOWED_CIRCLES
    assert out["function_imports"] == sum(out["function_imports_by_module"].values()) > 0
    assert all(n > 800 for n in out["long_modules"].values())
