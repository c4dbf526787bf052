"""Deep research (long-horizon agents, SPEC §3.5, issue 21): ``agents.deep_research``.

A task asks whether two entities of a seeded knowledge graph (`k3post.envs.families.kg`) end in the same
country along the same relation chain, e.g. "Were the founders of Brightmoor Labs and Kelvor Works born in
the same country?". Answering means following the chain for both entities: 2 hops each at difficulty 1
(4 documents), 3 hops each at difficulty 2-3 (6 documents), one search and one open per hop. The tools are
`agents.search`'s (``search``, ``open``, ``submit``); the answer is written text that starts with Yes or No,
names the entities along both chains and cites the documents as ``[d07]``.

The verifier reads the submitted text and the environment's state (the searches run, the documents
opened), never what the agent says it did. Reward 1 iff all of:

* ``verdict``: the first word is the right Yes / No;
* ``facts``: every entity on both chains is named, and no other country (no hedging over candidates);
* ``citations``: the cited ids are exactly the documents that state the hops (each exists, each supports a
  stated fact, none missing);
* ``read``: every cited document was opened in this episode;
* ``searches``: at least `MIN_SEARCHES` searches were run.
"""

from __future__ import annotations

import random
import re
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.agents.family import SEARCH_TOOLS, hop_path
from k3post.envs.families.common import FamilyBase, assistant, normalize_answer, prompt_text, submission_text, tool_call
from k3post.envs.families.kg import CHAINS, KnowledgeGraph, build_graph, lexicon as kg_lexicon, relation_phrase
from k3post.envs.families.registry import register_family
from k3post.envs.task import FinalState, Task, Verdict, register_verifier

__all__ = ["DeepResearchFamily", "MIN_SEARCHES", "verify_deep_research"]

MIN_SEARCHES = 4
"""Searches the state must record (ours: one per hop, two chains of at least 2 hops)."""

_CITE = re.compile(r"\[(d\d+)\]")
_QUESTION = {
    ("hq", "in_country"): "Are {a} and {b} headquartered in the same country?",
    ("born_in", "in_country"): "Were {a} and {b} born in the same country?",
    ("founded_by", "born_in", "in_country"): "Were the founders of {a} and {b} born in the same country?",
    ("works_at", "hq", "in_country"): "Are the employers of {a} and {b} headquartered in the same country?",
    ("studied_at", "located_in", "in_country"): "Are the universities that {a} and {b} attended in the same country?",
}
_SYSTEM = (
    "You research questions in a private document collection with search and open. The question needs facts "
    "from several documents. Submit a short written answer: start with Yes or No, name the people, places and "
    "organisations each step led to, and cite every document you used as [d07]."
)


class DeepResearchFamily(FamilyBase):
    """``agents.deep_research``: compare two 2-3-hop chains; a cited written answer."""

    name = "agents.deep_research"
    domain = "agents"
    description = "deep research: compare two 2-3-hop chains over a local corpus (4-6 searches); written answer citing doc ids"
    verifiable = True
    kind = "research"  # opt-in: not in `default_families` (the demo's mix was measured without it)
    max_difficulty = 3
    id_prefix = "research"

    def lexicon(self) -> tuple[str, ...]:
        """The knowledge graph's words (`k3post.envs.families.kg.lexicon`)."""
        return kg_lexicon()

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        kg = build_graph(rng, size=difficulty)
        hops = 2 if difficulty == 1 else 3
        chain = rng.choice([c for c in CHAINS if len(c.relations) == hops and c.relations in _QUESTION])
        starts = sorted(e for e, v in kg.entities.items() if v["type"] == chain.start)
        if len(starts) < 2:
            return None
        a, b = rng.sample(starts, 2)
        pa, pb = hop_path(kg, a, chain), hop_path(kg, b, chain)
        if pa is None or pb is None or set(pa[0][:-1]) & set(pb[0][:-1]):
            return None  # a degenerate chain, or the chains share a hop: fewer than 2 * hops documents
        question = _QUESTION[chain.relations].format(a=kg.name(a), b=kg.name(b))
        same = pa[0][-1] == pb[0][-1]
        meta = {
            "docs": kg.docs, "entities": kg.entities, "edges": kg.edges, "relations": list(chain.relations),
            "paths": [pa[0], pb[0]], "path_docs": [pa[1], pb[1]], "same": same,
        }
        msgs = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": question}]
        return self._task(task_id, msgs, meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        """`agents.search`'s search / open / submit; a plain answer also ends the episode."""
        self._check_task(task)
        return ToolEnvironment(SEARCH_TOOLS, initial_state=lambda t: {"searches": [], "opened": []}, submit_tool="submit",
                               end_on_text=True, limits=EpisodeLimits(max_turns=24))

    def _kg(self, task: Task) -> KnowledgeGraph:
        m = task.metadata
        return KnowledgeGraph(dict(m["entities"]), dict(m["edges"]), dict(m["docs"]))

    def answer_text(self, task: Task, *, same: bool | None = None, cite: bool = True, extra: str = "") -> str:
        """The written answer: verdict, then each chain's steps with the citing document after each fact."""
        m = task.metadata
        kg = self._kg(task)
        same = m["same"] if same is None else same
        parts = []
        for path, pdocs in zip(m["paths"], m["path_docs"]):
            steps = [f"the {relation_phrase(r)} of {kg.name(path[i])} is {kg.name(path[i + 1])}" + (f" [{pdocs[i]}]" if cite else "")
                     for i, r in enumerate(m["relations"])]
            parts.append("; ".join(steps))
        verdict = "Yes, the same country" if same else "No, different countries"
        return f"{verdict}. " + ". ".join(p[0].upper() + p[1:] for p in parts) + "." + extra

    def _research(self, task: Task, effort: str, chains: tuple[int, ...] = (0, 1)) -> list[dict[str, Any]]:
        """search → open for every hop of the given chains; the reasoning quotes what each hop found."""
        m = task.metadata
        kg = self._kg(task)
        turns = []
        for c in chains:
            path, pdocs = m["paths"][c], m["path_docs"][c]
            for i, rel in enumerate(m["relations"]):
                n, did = kg.name(path[i]), pdocs[i]
                if i > 0 and effort == "max":
                    think = f"{pdocs[i - 1]} says: {kg.sentence(path[i - 1], m['relations'][i - 1])} Next: the {relation_phrase(rel)} of {n}."
                elif effort == "max":
                    think = f"Chain {c + 1}: start at {n}; first the {relation_phrase(rel)}."
                else:
                    think = {"high": f"{relation_phrase(rel)} of {n}.", "low": ""}[effort]
                turns.append(assistant("", think, [tool_call(f"s{c}{i}", "search", {"query": n})]))
                turns.append(assistant("", {"max": f"{did} is the page of {n}.", "high": f"Open {did}.", "low": ""}[effort],
                                       [tool_call(f"o{c}{i}", "open", {"doc_id": did})]))
        return turns

    def _submit(self, answer: str, think: str = "") -> dict[str, Any]:
        return assistant("", think, [tool_call("submit", "submit", {"answer": answer})])

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """Research both chains hop by hop, then submit the cited answer."""
        m = task.metadata
        kg = self._kg(task)
        ends = [kg.name(p[-1]) for p in m["paths"]]
        last = [kg.sentence(p[-2], m["relations"][-1]) for p in m["paths"]]
        think = {"max": f"{last[0]} {last[1]} So: {ends[0]} vs {ends[1]}.", "high": f"{ends[0]} vs {ends[1]}.", "low": ""}[effort]
        return self._research(task, effort) + [self._submit(self.answer_text(task), think)]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied question, success claim, one search only, cites a non-existent / an unread / an
        irrelevant document, no citations, wrong verdict, half the research, hedging over every country."""
        m = task.metadata
        kg = self._kg(task)
        research = self._research(task, "low")
        answer = self.answer_text(task)
        support = {d for ds in m["path_docs"] for d in ds}
        unread = sorted(set(m["docs"]) - support)[0]
        first_doc = m["path_docs"][0][0]
        names = {m["entities"][e]["name"] for p in m["paths"] for e in p}
        others = sorted(v["name"] for v in m["entities"].values() if v["type"] == "country" and v["name"] not in names)
        out = {
            "empty": [assistant("")],
            "copied_prompt": [self._submit(prompt_text(task))],
            "claims_success": [assistant("I searched every document and verified the answer. The task is complete.")],
            "one_search": research[:2] + [self._submit(answer)],
            "cites_nonexistent": research + [self._submit(answer + " See also [d99].")],
            "cites_unread": research + [self._submit(answer + f" See also [{unread}].")],
            "no_citations": research + [self._submit(self.answer_text(task, cite=False))],
            "wrong_verdict": research + [self._submit(self.answer_text(task, same=not m["same"]))],
            "half_research": self._research(task, "low", (0,)) + [self._submit(answer)],
            "first_doc_only": research + [self._submit(answer.split(".")[0] + f". {kg.name(m['paths'][0][1])} [{first_doc}].")],
        }
        if others:  # hedging needs a country off the chains to name
            out["all_countries"] = research + [self._submit(answer + " It could also be " + ", ".join(others) + ".")]
        return out


@register_verifier("agents.deep_research")
def verify_deep_research(task: Task, final: FinalState) -> Verdict:
    """1.0 iff verdict, facts, citations, read and searches all hold (see the module docstring)."""
    m = task.metadata
    text = submission_text(final.submission)
    state = final.state if isinstance(final.state, dict) else {}
    norm = f" {normalize_answer(text)} "
    first = normalize_answer(text).split(" ")[0] if text.strip() else ""
    verdict_ok = first == ("yes" if m["same"] else "no")
    names = {m["entities"][e]["name"] for p in m["paths"] for e in p}
    countries = {v["name"] for v in m["entities"].values() if v["type"] == "country"}
    named = all(f" {normalize_answer(n)} " in norm for n in names)
    hedged = [c for c in countries - names if f" {normalize_answer(c)} " in norm]
    cited = set(_CITE.findall(text))
    support = {d for ds in m["path_docs"] for d in ds}
    opened = set(state.get("opened", []))
    comps = {
        "verdict": float(verdict_ok),
        "facts": float(named and not hedged),
        "citations": float(cited == support),
        "read": float(bool(cited) and cited <= opened),
        "searches": float(len(state.get("searches", [])) >= MIN_SEARCHES),
    }
    ok = all(v == 1.0 for v in comps.values())
    diag = "" if ok else (f"verdict {first!r}; missing names {sorted(n for n in names if f' {normalize_answer(n)} ' not in norm)}; "
                          f"other countries {hedged}; cited {sorted(cited)} vs support {sorted(support)}; unread cited "
                          f"{sorted(cited - opened)}; searches {len(state.get('searches', []))}")
    return Verdict(float(ok), comps, diag)


DEEP_RESEARCH = register_family(DeepResearchFamily())
