"""KG-guided task synthesis (`k3post synth-tasks`, `k3post.synth.kg_tasks`): the concept DAG, the verification
funnel on hand-built adversarial candidates, synthesised tasks in agents.search, determinism, the CLI, and the
explorer over an OpenAI-compatible endpoint (a local stub server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from chat_stub import ChatStub

from k3post.envs.episode import run_episode_sync
from k3post.envs.families.agents.family import SEARCH
from k3post.synth.kg_tasks import (
    CorpusExplorer,
    EndpointExplorer,
    FactStore,
    answers,
    default_corpus,
    extract_facts,
    grow_dag,
    synth_tasks,
    verify_candidates,
)

# A corpus small enough to reason about by hand: two software companies, one steel company, their founders,
# two cities of one country.
DOCS = {
    "d1": {"title": "Alpha Labs", "text": "Alpha Labs is a software company. Alpha Labs was founded by Ann Reed."},
    "d2": {"title": "Beta Works", "text": "Beta Works is a steel company. Beta Works was founded by Bob Stone."},
    "d3": {"title": "Ann Reed", "text": "Ann Reed is an engineer. Ann Reed was born in Mora."},
    "d4": {"title": "Bob Stone", "text": "Bob Stone is a pilot. Bob Stone was born in Kesh."},
    "d5": {"title": "Mora", "text": "Mora is a city in Xland."},
    "d6": {"title": "Kesh", "text": "Kesh is a city in Xland."},
    "d7": {"title": "Xland", "text": "Xland is a country. Its cities include Mora, Kesh."},
    "d8": {"title": "Gamma Systems", "text": "Gamma Systems is a software company. Gamma Systems was founded by Bob Stone."},
}


@pytest.fixture(autouse=True)
def _search_generates() -> Any:
    yield
    SEARCH.use_synth_tasks(None)  # the registered family is shared: leave it generating graphs


class ScriptedExplorer:
    """Proposes from a fixed table and records which concepts it was asked about."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table, self.asked = table, []

    def propose(self, concept: str, evidence: list[str]) -> list[str]:
        self.asked.append(concept)
        return self.table.get(concept, [])


def test_facts_are_entity_linked_triples() -> None:
    facts = {(f.subject, f.predicate, f.obj) for f in extract_facts(DOCS)}
    assert ("Alpha Labs", "was founded by", "Ann Reed") in facts
    assert ("Mora", "is a city in", "Xland") in facts
    assert {("Xland", "its cities include", "Mora"), ("Xland", "its cities include", "Kesh")} <= facts
    assert not any(f[0] == f[2] for f in facts)


def test_dag_merges_duplicates_drops_ungrounded_and_not_finer_and_stops_at_atomic() -> None:
    ex = ScriptedExplorer({
        "company": ["Software Companies", "software company", "steel company", "Quantum Bakery", "company", "engineer"],
        "Software Companies": ["Alpha Labs", "Gamma Systems", "Beta Works"],
        "steel company": ["Beta Works"],  # never asked: "steel company" grounds to d2 alone, so it is atomic
    })
    dag = grow_dag(DOCS, ["company"], ex)
    by_label = {c.label: c for c in dag.nodes.values()}
    # "software company" folds to the same concept as "Software Companies": merged, not a second node
    assert "software company" not in by_label and by_label["Software Companies"].docs == ["d1", "d8"]
    # "Quantum Bakery" grounds nowhere; "company" and "engineer" are not finer than "company" (not a subset / equal);
    # "Beta Works" under software companies is not within their documents
    st = dag.stats()
    assert (st["merged"], st["ungrounded"], st["not_finer"]) == (1, 1, 3)
    assert by_label["steel company"].atomic and by_label["steel company"].children == []
    assert "steel company" not in ex.asked and "Alpha Labs" not in ex.asked  # growth stops at atomic concepts
    # coarse → fine: depth grows along every edge and a child's documents are a subset of its parent's
    for c in dag.nodes.values():
        for k in c.children:
            assert dag.nodes[k].depth == c.depth + 1 and set(dag.nodes[k].docs) < set(c.docs)
    assert [by_label[x].depth for x in ("company", "Software Companies", "Alpha Labs")] == [0, 1, 2]
    assert st == {"nodes": 5, "edges": 4, "atomic": 3, "seeds": 1, "max_depth": 2, "proposed": 9, "merged": 1,
                  "ungrounded": 1, "not_finer": 3}


def test_dag_merge_adds_an_edge_from_a_second_parent_and_max_depth_stops_growth() -> None:
    # the same single document reached twice is one node with two parents
    ex2 = ScriptedExplorer({"city": ["Mora", "city in Xland"], "city in Xland": ["Mora", "Kesh"]})
    dag2 = grow_dag(DOCS, ["city"], ex2)
    mora = next(c for c in dag2.nodes.values() if c.label == "Mora")
    assert len(mora.parents) == 2 and dag2.counts["merged"] == 1
    shallow = grow_dag(DOCS, ["city"], ScriptedExplorer(ex2.table), max_depth=1)
    assert shallow.stats()["max_depth"] == 1 and not any(c.label == "Kesh" for c in shallow.nodes.values())


def test_offline_dag_over_the_default_corpus_ends_in_atomic_concepts() -> None:
    docs = default_corpus(0)
    ex = CorpusExplorer(docs)
    assert {"company", "city", "country", "university"} <= set(ex.seeds())
    dag = grow_dag(docs, ex.seeds(), ex)
    leaves = [c for c in dag.nodes.values() if not c.children]
    assert leaves and all(c.atomic for c in leaves)  # growth went down to atomic concepts everywhere
    assert {docs[c.docs[0]]["title"] for c in dag.nodes.values() if c.atomic} == {v["title"] for v in docs.values()}
    company = next(c for c in dag.nodes.values() if c.label == "company")
    assert company.depth == 0 and all(dag.nodes[k].label.endswith("company") for k in company.children)
    assert all(dag.nodes[k].atomic for k in company.children for k in dag.nodes[k].children)


# --------------------------------------------------------------------------- the funnel


def _mh(cid: str, start: str, preds: list[str], answer: str, evidence: list[str], question: str = "") -> dict[str, Any]:
    q = question or f"{start} {' then '.join(preds)} what? ({cid})"
    return {"id": cid, "type": "multi_hop", "question": q, "answer": answer, "evidence": evidence,
            "program": {"type": "multi_hop", "start": start, "preds": preds}}


def test_each_funnel_stage_rejects_what_it_should() -> None:
    good = _mh("good", "Alpha Labs", ["was founded by", "was born in"], "Mora", ["d1", "d3"], "Alpha Labs was founded by X1. X1 was born in X2. What is X2?")
    cands = [
        good,
        _mh("wrong_answer", "Alpha Labs", ["was founded by", "was born in"], "Kesh", ["d1", "d3"]),
        _mh("missing_evidence", "Alpha Labs", ["was founded by", "was born in"], "Mora", ["d1"]),
        # both companies' founders were born in a city of Xland: two answers
        {"id": "ambiguous", "type": "comparison", "question": "Of Alpha Labs and Beta Works, which one ...?", "answer": "Alpha Labs",
         "evidence": ["d1", "d2", "d3", "d4", "d5", "d6"],
         "program": {"type": "comparison", "items": ["Alpha Labs", "Beta Works"], "preds": ["was founded by", "was born in", "is a city in"], "target": "Xland"}},
        _mh("single_doc", "Alpha Labs", ["was founded by"], "Ann Reed", ["d1"]),
        # one hop of a comparison: Alpha Labs' own page names its founder, and the question promises one answer
        {"id": "single_doc_comparison", "type": "comparison", "question": "Of Alpha Labs and Beta Works, which one was founded by Ann Reed?",
         "answer": "Alpha Labs", "evidence": ["d1", "d2"],
         "program": {"type": "comparison", "items": ["Alpha Labs", "Beta Works"], "preds": ["was founded by"], "target": "Ann Reed"}},
        # Xland's page lists both cities: it answers "how many of Mora and Kesh are cities in Xland" alone,
        # although no program over its facts does (they run city → country, the page says country → cities)
        {"id": "one_page_lists_all", "type": "aggregation", "question": "Of Mora and Kesh, how many is a city in Xland?", "answer": "2",
         "evidence": ["d5", "d6"], "program": {"type": "aggregation", "items": ["Mora", "Kesh"], "preds": ["is a city in"], "target": "Xland"}},
        _mh("leaks", "Alpha Labs", ["was founded by", "was born in"], "Mora", ["d1", "d3"], "Alpha Labs's founder was born in Mora or Kesh?"),
        _mh("duplicate_question", "Alpha Labs", ["was founded by", "was born in"], "Mora", ["d3", "d1"], "What is X2? X1 was born in X2. Alpha Labs was founded by X1."),
        _mh("duplicate_content", "Alpha Labs", ["was founded by", "was born in"], "Mora", ["d3", "d1"], "Which city was Alpha Labs' founder born in?"),
        {"id": "count", "type": "aggregation", "question": "Of Alpha Labs, Beta Works and Gamma Systems, how many ... Kesh?", "answer": "2",
         "evidence": ["d1", "d2", "d8", "d3", "d4"],
         "program": {"type": "aggregation", "items": ["Alpha Labs", "Beta Works", "Gamma Systems"], "preds": ["was founded by", "was born in"], "target": "Kesh"}},
    ]
    kept, rejected, funnel = verify_candidates(DOCS, cands)
    assert [k["id"] for k in kept] == ["good", "count"]
    assert {r["id"]: (r["stage"], r["reason"]) for r in rejected} == {
        "wrong_answer": ("supported", "unsupported"),
        "missing_evidence": ("supported", "unsupported"),
        "ambiguous": ("unique", "ambiguous"),
        "single_doc": ("multi_doc", "single_doc"),
        "single_doc_comparison": ("multi_doc", "single_doc"),
        "one_page_lists_all": ("multi_doc", "one_doc_names_all"),
        "leaks": ("multi_doc", "answer_in_question"),
        "duplicate_question": ("novel", "duplicate"),
        "duplicate_content": ("novel", "duplicate"),
    }
    f = funnel.to_dict()
    assert (f["total"], f["kept"], f["rejected"]) == (11, 2, 9)
    assert [(s["name"], s["seen"], s["kept"]) for s in f["stages"]] == [
        ("supported", 11, 9), ("unique", 9, 8), ("multi_doc", 8, 4), ("retrievable", 4, 4), ("novel", 4, 2), ("verifies", 2, 2)]
    # an existing set counts for the duplicate check
    kept2, rej2, _ = verify_candidates(DOCS, [good], existing=[good])
    assert not kept2 and rej2[0]["reason"] == "duplicate"


def test_retrievable_rejects_evidence_the_search_tool_does_not_show() -> None:
    # three companies named after the city outrank the city's own page for the query "Mora" (top 3 shown)
    docs = {"d1": {"title": "Mora", "text": "Mora is a city in Xland."}, "d5": {"title": "Xland", "text": "Xland is a country."},
            **{f"d{k}": {"title": f"Mora Mora {s}", "text": f"Mora Mora {s} is a company. Mora Mora {s} is headquartered in Mora."}
               for k, s in ((2, "Labs"), (3, "Works"), (4, "Press"))}}
    cand = _mh("hidden_page", "Mora Mora Labs", ["is headquartered in", "is a city in"], "Xland", ["d2", "d1"])
    kept, rejected, _ = verify_candidates(docs, [cand])
    assert not kept and (rejected[0]["stage"], rejected[0]["reason"]) == ("retrievable", "not_retrievable")
    assert "d1" in rejected[0]["detail"]


def test_answers_golden() -> None:
    store = FactStore(extract_facts(DOCS))
    agg = {"type": "aggregation", "items": ["Alpha Labs", "Beta Works", "Gamma Systems"], "preds": ["was founded by", "was born in"], "target": "Kesh"}
    # Alpha Labs → Ann Reed → Mora; Beta Works → Bob Stone → Kesh; Gamma Systems → Bob Stone → Kesh: 2
    assert answers(agg, store) == {"2"}
    assert answers(agg, store.restrict(["d1", "d2", "d8", "d4"])) == set()  # Ann Reed's birthplace unknown
    assert answers({**agg, "type": "comparison", "items": ["Alpha Labs", "Beta Works"]}, store.restrict(["d2", "d4"])) == {"Beta Works"}
    assert answers({"type": "multi_hop", "start": "Xland", "preds": ["its cities include"]}, store) == {"Mora", "Kesh"}


# --------------------------------------------------------------------------- synthesised tasks in agents.search


def test_synthesised_tasks_score_1_with_the_reference_and_0_with_hacks(tmp_path: Path) -> None:
    s = synth_tasks(tmp_path, n=30, seed=3)
    assert s["kept"] >= 10 and all(v > 0 for v in s["kept_by_type"].values())
    recs = [json.loads(x) for x in (tmp_path / "kg_tasks.jsonl").read_text().splitlines()]
    store = FactStore(extract_facts(recs[0]["docs"]))
    SEARCH.use_synth_tasks(str(tmp_path / "kg_tasks.jsonl"))
    for k, rec in enumerate(recs):
        assert answers(rec["program"], store) == {rec["answer"]}  # verifiable: the corpus gives exactly that answer
        task = SEARCH.synth_task(rec, f"t{k}")
        for effort in ("low", "high", "max"):
            ep = run_episode_sync(SEARCH.reference_policy(task, effort), SEARCH.make_env(task), task)
            assert ep.verdict is not None and ep.verdict.reward == 1.0, (rec["question"], ep.verdict)
            assert ep.verdict.components["path_docs_opened"] == 1.0
        for name, pol in SEARCH.wrong_policies(task).items():
            ep = run_episode_sync(pol, SEARCH.make_env(task), task)
            assert ep.verdict is None or ep.verdict.reward == 0.0, (name, rec["question"])
    drawn = SEARCH.generate(5, seed=0)
    assert all("synth" in t.metadata for t in drawn)
    SEARCH.use_synth_tasks(None)
    assert "synth" not in SEARCH.generate(1, seed=0)[0].metadata


def test_synthesis_is_deterministic_with_a_seed(tmp_path: Path) -> None:
    names = ("kg_dag.json", "kg_tasks.jsonl", "kg_rejected.jsonl", "kg_funnel.json")
    synth_tasks(tmp_path / "a", n=20, seed=5)
    synth_tasks(tmp_path / "b", n=20, seed=5)
    synth_tasks(tmp_path / "c", n=20, seed=6)
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)
    assert (tmp_path / "a" / "kg_tasks.jsonl").read_bytes() != (tmp_path / "c" / "kg_tasks.jsonl").read_bytes()


def test_cli_end_to_end_on_a_small_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3post.cli import _load, main
    from k3post.recipes.report import write_report

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d, "title": v["title"], "text": v["text"]}) + "\n" for d, v in default_corpus(1).items()))
    run = tmp_path / "run"
    assert main(["synth-tasks", "--out", str(run), "--corpus", str(corpus), "--n", "24", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "concept DAG:" in out and "multi_doc" in out and "kept" in out
    summary = json.loads((run / "kg_funnel.json").read_text())
    assert summary["dag"]["nodes"] > 10 and summary["funnel"]["total"] == 24 and summary["kept"] > 0
    assert main(["tasks", "sample", "agents.search", "--synth-tasks", str(run / "kg_tasks.jsonl")]) == 0
    assert "## verdict: reward 1" in capsys.readouterr().out
    page = write_report(run).read_text()
    assert "KG-guided task synthesis" in page and "single_doc" in page
    SEARCH.use_synth_tasks(None)
    _load(None, [f"data.search_tasks={run / 'kg_tasks.jsonl'}"])  # the config key
    assert SEARCH.synth_records is not None and len(SEARCH.synth_records) == summary["kept"]
    # user errors: one line, exit 2
    assert main(["synth-tasks", "--out", str(run), "--explorer-url", "http://127.0.0.1:9"]) == 2
    assert main(["synth-tasks", "--out", str(run), "--corpus", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["synth-tasks", "--out", str(run), "--corpus", str(corpus), "--seeds", "quantum bakery"]) == 2
    assert main(["tasks", "sample", "agents.search", "--synth-tasks", str(corpus)]) == 2
    assert "missing" in capsys.readouterr().err


# --------------------------------------------------------------------------- explorer over an endpoint


_TABLE = {"company": "1. Software Companies\n2. steel company\n- Quantum Bakery", "Software Companies": "- Alpha Labs\n- Gamma Systems"}


def _explorer_reply(body: dict[str, Any]) -> tuple[int, Any]:
    """The stub model: the sub-concepts of the prompt's concept from `_TABLE`, else NONE."""
    concept = body["messages"][0]["content"].split("Concept: ", 1)[1].split("\n", 1)[0]
    return 200, {"choices": [{"message": {"role": "assistant", "content": _TABLE.get(concept, "NONE")}}]}


def test_endpoint_explorer_against_a_local_stub_server(tmp_path: Path) -> None:
    with ChatStub(_explorer_reply) as srv:
        dag = grow_dag(DOCS, ["company"], EndpointExplorer(srv.url, "stub-model"))
        labels = sorted(c.label for c in dag.nodes.values())
        assert labels == ["Alpha Labs", "Gamma Systems", "Software Companies", "company", "steel company"]
        assert dag.counts["ungrounded"] == 1  # the model's "Quantum Bakery" is not in the corpus
        assert all(r["path"] == "/v1/chat/completions" and r["body"]["model"] == "stub-model" for r in srv.requests)
        assert "Alpha Labs: Alpha Labs is a software company." in srv.requests[1]["body"]["messages"][0]["content"]
        assert len(srv.requests) == 2  # asked about "company" and "Software Companies" only: the rest are atomic
        # the same through the CLI
        from k3post.cli import main

        corpus = tmp_path / "c.jsonl"
        corpus.write_text("".join(json.dumps({"id": d, **v}) + "\n" for d, v in DOCS.items()))
        assert main(["synth-tasks", "--out", str(tmp_path / "run"), "--corpus", str(corpus), "--n", "6", "--seeds", "company",
                     "--explorer-url", srv.url, "--explorer-model", "stub-model"]) == 0
        assert json.loads((tmp_path / "run" / "kg_funnel.json").read_text())["dag"]["nodes"] == 5
