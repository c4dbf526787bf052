"""Agents-domain families: multi-hop search over a local corpus, and a personal assistant with mock apps.

``agents.search`` (verifiable)
    Each task carries a seeded knowledge graph of fictional people, companies, universities,
    cities and countries (`k3post.envs.families.kg`) and its corpus, one document per entity.
    The question follows a chain of 2 (difficulty 1) or 3 (difficulty 2-3) relations, e.g.
    "In which country was the founder of Brightmoor Labs born?", so answering means opening one
    document per hop. Tools: ``search(query)`` (BM25, top 3 ``id | title | first sentence``),
    ``open(doc_id)`` and ``submit(answer)``; a plain-text final answer also counts as the
    submission. The verifier compares the normalised answer with the graph's answer, and
    nothing else: guesses, the intermediate entity, a list of every candidate name, the copied
    question or a success claim all score 0. Difficulty also grows the graph (about 15 / 22 / 30
    documents).

``agents.assistant`` (verifiable, rewarded on the final app state)
    Mock mail, calendar and docs apps (`k3post.envs.families.agents.apps`) over a work week. A contact
    emails a request: move a meeting to a proposed time (difficulty >= 2: "at T1, or T2 if T1 is
    taken", and T1 clashes with another event), cancel a meeting, or answer a question from a
    document. The verifier reads only the final state: the calendar must equal the expected
    calendar exactly (the right event moved / cancelled, nothing else changed), there must be a
    reply to the requester that mentions the outcome (new date or weekday and time; the cancelled
    meeting's title; the document value) and not the rejected time, no email to anyone else, and
    the docs must be unchanged. What the agent says it did is never read.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import random
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.agents.apps import APP_TOOLS, hhmm, minutes, overlaps, weekday
from k3post.envs.families.common import (
    FamilyBase,
    assistant,
    normalize_answer,
    prompt_text,
    submission_text,
    tool_call,
)
from k3post.envs.families.kg import CHAINS, KnowledgeGraph, bm25_search, build_graph, first_sentence, lexicon as kg_lexicon, relation_phrase
from k3post.envs.families.registry import register_family
from k3post.io import read_jsonl
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = ["SearchFamily", "AssistantFamily", "SEARCH_TOOLS", "hop_path"]

_CLAIM = "All tests passed. The task is complete."

# =========================================================================== search


def _search(ctx: ToolContext, query: str) -> str:
    assert ctx.task is not None
    docs = ctx.task.metadata["docs"]
    hits = bm25_search(docs, query, k=3)
    ctx.state["searches"].append(query)
    if not hits:
        return "No results."
    return "\n".join(f"{d} | {docs[d]['title']} | {first_sentence(docs[d]['text'])}" for d, _ in hits)


def _open(ctx: ToolContext, doc_id: str) -> str:
    assert ctx.task is not None
    docs = ctx.task.metadata["docs"]
    if doc_id not in docs:
        raise ValueError(f"no document {doc_id!r}; use an id from the search results, e.g. d01")
    ctx.state["opened"].append(doc_id)
    d = docs[doc_id]
    return f"{d['title']}\n{d['text']}"


SEARCH_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "search",
        "Search the document collection; returns up to 3 hits as 'id | title | first sentence'.",
        {"type": "object", "properties": {"query": {"type": "string", "minLength": 1}}, "required": ["query"], "additionalProperties": False},
        True,
        _search,
    ),
    ToolSpec(
        "open",
        "Open a document by id and return its full text.",
        {"type": "object", "properties": {"doc_id": {"type": "string", "description": "e.g. d07"}}, "required": ["doc_id"], "additionalProperties": False},
        True,
        _open,
    ),
    ToolSpec(
        "submit",
        "Submit the final answer (a short name) and end the episode.",
        {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False},
        False,
        None,
    ),
)

_SEARCH_SYSTEM = (
    "You answer questions about a private document collection. Use search and open to find the facts; "
    "the answer needs facts from more than one document. Finish by calling submit with the answer only."
)


def hop_path(kg: KnowledgeGraph, start: str, chain: Any) -> tuple[list[str], list[str]] | None:
    """(entities on the path from ``start`` along ``chain.relations``, the document of each hop) when every
    entity is distinct and each hop's page is among the top 3 hits of a search for its name; else None."""
    path = kg.follow(start, chain.relations)
    if len(set(path)) < len(path):
        return None  # e.g. a person who works at the company they founded: a degenerate chain
    docs_on_path = []
    for eid in path[:-1]:  # the reference finds each hop's page among the top 3 hits
        did = kg.doc_of(eid)
        if did not in [d for d, _ in bm25_search(kg.docs, kg.name(eid), k=3)]:
            return None
        docs_on_path.append(did)
    return path, docs_on_path


def _hits_line(docs: dict[str, Any], query: str, want: str, kinds: dict[str, Any] | None = None) -> str:
    """What a search for ``query`` returns (the tool's own BM25), checked against the page ``want``; with the graph's
    entities (``kinds``), each other hit is named with its kind."""
    hits = [d for d, _ in bm25_search(docs, query, k=3)]
    listed = "; ".join(f"{d} {docs[d]['title']}" for d in hits)
    others = [docs[d]["title"] + (f" (a {kinds[docs[d]['entity']]['type']}: {first_sentence(docs[d]['text'])})" if kinds else "")
              for d in hits if d != want]
    rest = f"; {', '.join(others)} {'is another page' if len(others) == 1 else 'are other pages'}" if others else ""
    return f"Hits: {listed}. {want} is titled exactly {docs[want]['title']}, the page I need{rest}."


def _search_script(task: Task, effort: str) -> list[tuple[str, str, dict[str, str]]]:
    """The generated-graph reference as (thinking, tool, arguments) per turn: search and open per hop, then
    submit. The thinking comes from the task's graph: none at ``low``, a line at ``high``; at ``max`` the
    chain planned from the question, each search's hits checked against the name searched, each opened
    page's facts sorted into the one the hop needs and the others, and the answer checked before it is
    submitted: its own page is looked up (when a search for it finds it) to confirm it is of the kind asked."""
    m = task.metadata
    kg = KnowledgeGraph(dict(m["entities"]), dict(m["edges"]), dict(m["docs"]))
    rels, path, pdocs, docs = m["relations"], m["path"], m["path_docs"], m["docs"]
    names = [kg.name(e) for e in path]
    kinds = [kg.entities[e]["type"] for e in path]
    hops, ans = len(rels), names[-1]

    def expect(i: int) -> str:  # the sentence hop i looks for, with its object left open
        return kg.sentence(path[i], rels[i]).replace(names[i + 1], "...")

    out: list[tuple[str, str, dict[str, str]]] = []
    for i, rel in enumerate(rels):
        n, did, ph = names[i], pdocs[i], relation_phrase(rel)
        if effort != "max":
            hi = effort == "high"
            prev = f"Find the {ph} of {n}." if i == 0 else f"{relation_phrase(rels[i - 1])}: {n}."
            out += [(prev if hi else "", "search", {"query": n}), (f"Open {did}." if hi else "", "open", {"doc_id": did})]
            continue
        if i == 0:
            steps = ", then ".join(f"the {relation_phrase(r)} of that {kinds[j]}" if j else f"the {relation_phrase(r)} of {n}"
                                   for j, r in enumerate(rels))
            think = (f"The question starts from {n}, a {kinds[0]}, and asks for a {kinds[-1]}: {hops} hops, {steps}. "
                     f"Each hop needs the page of its subject. Hop 1: search {n}; its page should say: {expect(0)}")
        else:
            e, r0 = path[i - 1], rels[i - 1]
            rest = " ".join(kg.sentence(e, r) for r in kg.edges[e] if r != r0)
            think = (f"{pdocs[i - 1]} says: {kg.sentence(e, r0)} So the {relation_phrase(r0)} of {names[i - 1]} is {n}, a "
                     f"{kinds[i]}; its other facts ({rest}) are not asked. Hop {i + 1} of {hops}: the {ph} of {n}. Search {n}; "
                     f"its page should say: {expect(i)}")
        snippet = first_sentence(docs[did]["text"])
        out += [(think, "search", {"query": n}),
                (f"{_hits_line(docs, n, did, kg.entities)} Its snippet ({snippet}) fits {n}, a {kinds[i]}. Open {did} for the {ph} of {n}.",
                 "open", {"doc_id": did})]
    last = kg.sentence(path[-2], rels[-1])
    if effort != "max":
        return out + [(f"{relation_phrase(rels[-1])}: {ans}." if effort == "high" else "", "submit", {"answer": ans})]
    found = f"{pdocs[-1]} says: {last} So the {relation_phrase(rels[-1])} of {names[-2]} is {ans}."
    ans_doc = kg.doc_of(path[-1])
    checked = ""
    if ans_doc in [d for d, _ in bm25_search(docs, ans, k=3)]:
        out += [(f"{found} The question asks for a {kinds[-1]}; check that {ans} is one on its own page. Search {ans}.",
                 "search", {"query": ans}),
                (f"{_hits_line(docs, ans, ans_doc, kg.entities)} Open {ans_doc} to check the kind of {ans}.", "open", {"doc_id": ans_doc})]
        checked = f"{ans_doc} says: {first_sentence(docs[ans_doc]['text'])} So {ans} is a {kinds[-1]}, as asked. "
        found = ""
    chain = " ".join(f"{kg.sentence(path[j], r)} ({pdocs[j]})" for j, r in enumerate(rels))
    between = ", ".join(names[1:-1])
    think = (f"{found}{checked}The chain: {chain} {between} {'is a step' if hops == 2 else 'are steps'}, not the answer. "
             f"Submit {ans} alone.").lstrip()
    return out + [(think, "submit", {"answer": ans})]


class SearchFamily(FamilyBase):
    """``agents.search``: 2-3-hop questions over a corpus generated from a small knowledge graph."""

    name = "agents.search"
    domain = "agents"
    description = "multi-hop (2-3) questions over a local corpus built from a knowledge graph; search/open/submit tools"
    verifiable = True
    max_difficulty = 3
    id_prefix = "search"

    synth_records: list[dict[str, Any]] | None = None  # set by `use_synth_tasks`: draw from these instead

    def lexicon(self) -> tuple[str, ...]:
        """The words its entity names are built from (`k3post.envs.families.kg.lexicon`)."""
        return kg_lexicon()

    def use_synth_tasks(self, path: str | None) -> None:
        """Draw tasks from a synthesised set (``kg_tasks.jsonl`` of ``k3post synth-tasks``) instead of
        generating them; None goes back to generated graphs. ``data.search_tasks`` and
        ``k3post tasks sample --synth-tasks`` set it."""
        if not path:
            self.synth_records = None
            return
        recs = read_jsonl(path)
        for k, r in enumerate(recs, 1):
            missing = {"id", "type", "question", "answer", "evidence", "docs"} - set(r)
            if missing:
                raise ValueError(f"{path}:{k}: not a synthesised search task (missing {sorted(missing)})")
        if not recs:
            raise ValueError(f"{path}: no synthesised tasks")
        self.synth_records = recs

    def synth_task(self, rec: dict[str, Any], task_id: str) -> Task:
        """A task of this family from one synthesised record: its question over its corpus."""
        meta = {"docs": rec["docs"], "answer": rec["answer"], "path_docs": list(rec["evidence"]),
                "synth": {k: rec[k] for k in ("id", "type", "program", "concepts", "keywords") if k in rec}}
        msgs = [{"role": "system", "content": _SEARCH_SYSTEM}, {"role": "user", "content": rec["question"]}]
        return self._task(task_id, msgs, meta)

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        if self.synth_records is not None:
            return self.synth_task(rng.choice(self.synth_records), task_id)
        kg = build_graph(rng, size=difficulty)
        hops = 2 if difficulty == 1 else 3
        chain = rng.choice([c for c in CHAINS if len(c.relations) == hops])
        starts = [e for e, v in kg.entities.items() if v["type"] == chain.start]
        hop = hop_path(kg, rng.choice(starts), chain)
        if hop is None:
            return None
        path, docs_on_path = hop
        question = chain.question.format(x=kg.name(path[0]))
        meta = {
            "docs": kg.docs,
            "entities": kg.entities,
            "edges": kg.edges,
            "relations": list(chain.relations),
            "path": path,
            "path_docs": docs_on_path,
            "answer": kg.name(path[-1]),
        }
        msgs = [{"role": "system", "content": _SEARCH_SYSTEM}, {"role": "user", "content": question}]
        return self._task(task_id, msgs, meta)  # tools: the env's own (Task.tools empty)

    def make_env(self, task: Task) -> ToolEnvironment:
        """Search / open / submit over the task's corpus; a plain answer also ends the episode."""
        self._check_task(task)
        return ToolEnvironment(
            SEARCH_TOOLS,
            initial_state=lambda t: {"searches": [], "opened": []},
            submit_tool="submit",
            end_on_text=True,
            # a synthesised task may need more documents than a generated chain: search + open each, then submit
            limits=EpisodeLimits(max_turns=max(16, 2 * len(task.metadata["path_docs"]) + 4)),
        )

    def _kg(self, task: Task) -> KnowledgeGraph:
        m = task.metadata
        return KnowledgeGraph(dict(m["entities"]), dict(m["edges"]), dict(m["docs"]))

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """search → open for each hop, then submit. The thinking (`_search_script`) grows with the effort:
        none at ``low``, a line per turn at ``high``; at ``max`` the plan of the chain, each search's hits
        checked against the name, each opened page's sentences sorted into the one the hop needs and the
        rest, and the whole chain checked against the question before submitting."""
        m = task.metadata
        if "synth" in m:
            return self._synth_reference(task, effort)
        calls = {"search": "call_s", "open": "call_o"}
        turns: list[dict[str, Any]] = []
        for k, (think, name, args) in enumerate(_search_script(task, effort)):
            cid = "call_submit" if name == "submit" else f"{calls[name]}{k // 2}"
            turns.append(assistant("", think, [tool_call(cid, name, args)]))
        return turns

    def _synth_reference(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """A synthesised task: search each evidence document's title, open it, submit the answer."""
        m = task.metadata
        docs, ans, kind = m["docs"], m["answer"], m["synth"]["type"]
        turns: list[dict[str, Any]] = []
        titles = [docs[d]["title"] for d in m["path_docs"]]
        for i, did in enumerate(m["path_docs"]):
            title = docs[did]["title"]
            think = {"max": f"A {kind.replace('_', '-')} question over {len(titles)} documents: {', '.join(titles)}. "
                            f"Document {i + 1} of {len(titles)}: look up {title}.",
                     "high": f"Look up {title}.", "low": ""}[effort]
            turns.append(assistant("", think, [tool_call(f"call_s{i}", "search", {"query": title})]))
            turns.append(assistant("", {"max": f"{_hits_line(docs, title, did)} Open it.", "high": f"Open {did}.", "low": ""}[effort],
                                   [tool_call(f"call_o{i}", "open", {"doc_id": did})]))
        read = "; ".join(f"{d} {t}" for d, t in zip(m["path_docs"], titles))
        think = {"max": f"Read: {read}. The question: {task.messages[-1]['content']} Together these pages give {ans}. "
                        f"Submit {ans} alone.", "high": f"Answer: {ans}.", "low": ""}[effort]
        turns.append(assistant("", think, [tool_call("call_submit", "submit", {"answer": ans})]))
        return turns

    def _synth_wrong(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Hacks on a synthesised task: empty, copied question, claim, a guess, every candidate at once."""
        m = task.metadata
        ans = m["answer"]
        if ans.isdigit():
            guess, every = str(int(ans) + 1), ", ".join(str(k) for k in range(len(m["synth"].get("program", {}).get("items", ())) + 2))
        else:
            titles = sorted(d["title"] for d in m["docs"].values())
            guess = next(t for t in titles if normalize_answer(t) != normalize_answer(ans))
            items = m["synth"].get("program", {}).get("items") or [m["docs"][d]["title"] for d in m["path_docs"]]
            every = ", ".join(dict.fromkeys([*items, ans]))
        ref = self._synth_reference(task, "low")

        def submit(answer: str) -> dict[str, Any]:
            return assistant("", "", [tool_call("call_submit", "submit", {"answer": answer})])

        return {"empty": [assistant("")], "empty_submit": [submit("")], "copied_prompt": [submit(prompt_text(task))],
                "claims_success": [assistant(_CLAIM)], "guess_without_search": [submit(guess)],
                "all_candidates": ref[:-1] + [submit(every)], "wrong_after_search": ref[:-1] + [submit(guess)]}

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied question, success claim, a same-type guess, the first hop's entity, every candidate."""
        m = task.metadata
        if "synth" in m:
            return self._synth_wrong(task)
        kg = self._kg(task)
        path = m["path"]
        ans_type = kg.entities[path[-1]]["type"]
        same_type = sorted(kg.name(e) for e, v in kg.entities.items() if v["type"] == ans_type)
        guess = next(n for n in same_type if normalize_answer(n) != normalize_answer(m["answer"]))

        def submit(answer: str, think: str = "") -> dict[str, Any]:
            return assistant("", think, [tool_call("call_submit", "submit", {"answer": answer})])

        ref = self.reference_turns(task, "low")
        return {
            "empty": [assistant("")],
            "empty_submit": [submit("")],
            "copied_prompt": [submit(prompt_text(task))],
            "claims_success": [assistant(_CLAIM)],
            "guess_without_search": [submit(guess)],
            "first_hop_only": ref[:2] + [submit(kg.name(path[1]))],
            "all_candidates": ref[:-1] + [submit(", ".join(same_type))],
            "answer_sentence": ref[:-1] + [submit(kg.sentence(path[-2], m["relations"][-1]).replace(m["answer"], "it") + " " + _CLAIM)],
        }


@register_verifier("agents.search")
def verify_search(task: Task, final: FinalState) -> Verdict:
    """1.0 iff the submitted answer equals the knowledge-graph answer after normalisation."""
    got = normalize_answer(submission_text(final.submission))
    want = normalize_answer(task.metadata["answer"])
    ok = bool(got) and got == want
    state = final.state if isinstance(final.state, dict) else {}
    opened = state.get("opened", [])
    on_path = sum(1 for d in task.metadata["path_docs"] if d in opened) / len(task.metadata["path_docs"])
    return Verdict(
        float(ok),
        {"exact": float(ok), "path_docs_opened": on_path},
        f"expected {want!r}, got {got[:80]!r}; opened {opened}",
    )


# =========================================================================== personal assistant

_USER = {"name": "Alex Kim", "email": "alex@example.com"}
_CONTACTS = [("Bob Reyes", "bob@example.com"), ("Carol Diaz", "carol@example.com"), ("Dana Lee", "dana@example.com"),
             ("Evan Moss", "evan@example.com"), ("Fay Ortiz", "fay@example.com"), ("Gil Park", "gil@example.com")]
_TITLES = ["Design review", "Budget sync", "Roadmap planning", "Hiring debrief", "Vendor call", "Team lunch",
           "Sprint demo", "Security audit", "Customer check-in", "Launch prep", "Data review", "Board prep"]
_DOCS = ["Q2 budget", "Offsite plan", "Hiring plan", "Launch checklist", "Vendor contract"]
_FIELDS = ["Owner", "Budget", "Deadline"]
_MONDAY = dt.date(2026, 3, 2)
_NOISE = [("Newsletter: March edition", "Hi all, here is the March newsletter. No action needed."),
          ("Lunch on Friday?", "Anyone up for lunch on Friday? Just reply if you want to join."),
          ("Parking update", "The east car park is closed next week for repairs.")]


def _day(k: int) -> str:
    return (_MONDAY + dt.timedelta(days=k)).isoformat()


def _free(events: list[dict[str, Any]], date: str, start: int, end: int, skip: str = "") -> bool:
    return start >= 9 * 60 and end <= 18 * 60 and not any(overlaps(e, date, start, end) for e in events if e["id"] != skip)


class AssistantFamily(FamilyBase):
    """``agents.assistant``: handle a contact's emailed request with mock mail / calendar / docs apps."""

    name = "agents.assistant"
    domain = "agents"
    description = "personal assistant over mock mail, calendar and docs apps (move / cancel a meeting, answer from a doc); final app state checked"
    verifiable = True
    max_difficulty = 3
    id_prefix = "assist"

    def lexicon(self) -> tuple[str, ...]:
        """Contact names, meeting and document titles, document fields: what its replies copy."""
        words = [w for name, _ in _CONTACTS for w in name.split()] + [t for t in (*_TITLES, *_DOCS, *_FIELDS)]
        return tuple(dict.fromkeys(words))

    # ------------------------------------------------------------------ generation

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        contacts = rng.sample(_CONTACTS, 4)
        req_name, req_email = contacts[0]
        first = req_name.split()[0]
        events: list[dict[str, Any]] = []
        titles = rng.sample(_TITLES, 3 + 2 * difficulty)
        for k, title in enumerate(titles):
            for _ in range(50):
                date, start = _day(rng.randrange(5)), rng.randrange(18, 34) * 30  # 09:00 .. 16:30
                dur = rng.choice((30, 60))
                if _free(events, date, start, start + dur):
                    break
            else:
                return None
            who = [_USER["email"]] + sorted(e for _, e in rng.sample(contacts[1:], rng.randint(1, 2)))
            events.append({"id": f"e{k + 1}", "title": title, "date": date, "start": hhmm(start), "end": hhmm(start + dur), "attendees": who})
        kind = rng.choices(["move", "cancel", "doc_reply"], weights=[2, 1, 1])[0]
        target = events[0]
        target["attendees"] = sorted(set(target["attendees"]) | {req_email})
        rng.shuffle(events)  # the target is not always the first event listed
        docs = []
        for k, title in enumerate(rng.sample(_DOCS, 3)):
            owner = rng.choice(_CONTACTS)[0]
            fields = {"Owner": owner, "Budget": f"{rng.randint(10, 99)},{rng.randint(0, 9)}00 EUR", "Deadline": _day(rng.randint(7, 30))}
            docs.append({"id": f"doc{k + 1}", "title": title, "body": "\n".join(f"{f}: {v}" for f, v in fields.items()), "fields": fields})
        expected = [dict(e) for e in events]
        reply_none: list[str] = []
        info: dict[str, Any] = {"kind": kind, "event": target["id"], "title": target["title"]}
        when = f"{weekday(target['date'])} {target['date']} {target['start']}"
        if kind == "move":
            dur = minutes(target["end"]) - minutes(target["start"])
            date2 = _day(rng.randrange(5))
            slots = [s * 30 for s in range(18, 34)]
            free = [s for s in slots if _free(events, date2, s, s + dur, skip=target["id"]) and not (date2 == target["date"] and hhmm(s) == target["start"])]
            if not free:
                return None
            t_final = rng.choice(free)
            ask = f"to {weekday(date2)} {date2} at {hhmm(t_final)}"
            if difficulty >= 2:
                clash = [s for s in slots if not _free(events, date2, s, s + dur, skip=target["id"]) and s + dur <= 18 * 60]
                if not clash:
                    return None
                t1 = rng.choice(clash)
                ask = f"to {weekday(date2)} {date2} at {hhmm(t1)}, or {hhmm(t_final)} if {hhmm(t1)} is taken"
                reply_none = [hhmm(t1)]
                info["rejected"] = hhmm(t1)
            subject = f"Moving {target['title']}"
            body = f"Hi Alex, could we move {target['title']} ({when}) {ask}? Thanks, {first}"
            for e in expected:
                if e["id"] == target["id"]:
                    e.update(date=date2, start=hhmm(t_final), end=hhmm(t_final + dur))
            reply_any = [[date2, weekday(date2)], [hhmm(t_final)]]
            info.update(date=date2, start=hhmm(t_final), end=hhmm(t_final + dur))
            prompt = f"{req_name} asked by email to move a meeting. Move it to the time they proposed and reply to tell them the new time."
        elif kind == "cancel":
            subject = f"Cancel {target['title']}"
            body = f"Hi Alex, {target['title']} on {weekday(target['date'])} {target['date']} is no longer needed. Could you cancel it? Thanks, {first}"
            expected = [e for e in expected if e["id"] != target["id"]]
            reply_any = [[target["title"]]]
            prompt = f"{req_name} asked by email to cancel a meeting. Cancel it and reply to confirm."
        else:
            doc = rng.choice(docs)
            field = rng.choice(_FIELDS)
            value = doc["fields"][field]
            subject = f"Question about {doc['title']}"
            body = f"Hi Alex, what is the {field.lower()} in the {doc['title']} doc? Thanks, {first}"
            reply_any = [[value, value.replace(",", "")]]
            wrong = [d["fields"][field] for d in docs if d["fields"][field] != value]
            info.update(doc=doc["id"], doc_title=doc["title"], field=field, value=value, wrong_value=wrong[0] if wrong else "")
            prompt = f"{req_name} asked a question by email. Find the answer in the documents and reply to them with it."
        inbox = [{"from": req_email, "from_name": req_name, "subject": subject, "body": body}]
        for (name, email), (subj, text) in zip(contacts[1:], rng.sample(_NOISE, min(difficulty, len(_NOISE)))):
            inbox.append({"from": email, "from_name": name, "subject": subj, "body": f"{text} {name.split()[0]}"})
        if difficulty >= 3:  # another contact asks about a different meeting: must be left alone
            other = next(e for e in events if e["id"] != target["id"])
            name, email = contacts[1]
            inbox.append({"from": email, "from_name": name, "subject": f"About {other['title']}",
                          "body": f"Hi Alex, no need to change {other['title']} for now, I will write again. {name.split()[0]}"})
        rng.shuffle(inbox)
        for k, msg in enumerate(inbox):
            msg["id"] = f"m{k + 1}"
            msg["date"] = _day(0)
        info["message"] = next(msg["id"] for msg in inbox if msg["from"] == req_email)
        info.update(subject=subject, requester=req_name, requester_email=req_email, others=[e for _, e in contacts[1:]])
        state = {"user": _USER, "mail": {"inbox": inbox, "sent": []}, "calendar": events,
                 "docs": [{k: v for k, v in d.items() if k != "fields"} for d in docs]}
        meta = {
            "state": state,
            "expected_calendar": sorted(expected, key=lambda e: e["id"]),
            "reply_to": req_email,
            "reply_any_of": reply_any,
            "reply_none_of": reply_none,
            "info": info,
        }
        msgs = [
            {"role": "system", "content": "You are the assistant of Alex Kim (alex@example.com). Use the mail, calendar and docs tools. The week starts on Monday 2026-03-02."},
            {"role": "user", "content": prompt},
        ]
        return self._task(task_id, msgs, meta)  # tools: the env's own (Task.tools empty)

    def make_env(self, task: Task) -> ToolEnvironment:
        """The mock apps over a copy of the task's initial state; the final plain answer ends the episode."""
        self._check_task(task)
        return ToolEnvironment(
            APP_TOOLS,
            initial_state=lambda t: copy.deepcopy(dict(t.metadata["state"])),
            end_on_text=True,
            limits=EpisodeLimits(max_turns=16),
        )

    # ------------------------------------------------------------------ scripts

    def _steps(self, task: Task, effort: str) -> dict[str, dict[str, Any]]:
        """The reference's turns by role: inbox, read, look, act, reply, final; at ``max`` also ``look2`` (a move to
        another day lists that day in a turn of its own) and ``check`` (the changed day listed again, or the request
        read again, before replying).

        The thinking at ``max`` comes from the task's state, turn by turn: the plan from the request, the inbox
        sorted into the requester's email and the rest, the request restated with the meeting's length, each
        listed day's events with the clash and the free slot, the tool's answer checked against the request, and
        the final state checked against what the verifier reads (calendar, one reply, nothing else changed).
        ``high`` keeps a line per turn, ``low`` none."""
        m = task.metadata
        info, state = m["info"], m["state"]
        first = info["requester"].split()[0]
        mid = info["message"]
        ev = {e["id"]: e for e in state["calendar"]}
        mx = effort == "max"

        def T(mx: str, hi: str) -> str:  # the reasoning at this effort: thorough, terse or none
            return {"max": mx, "high": hi, "low": ""}[effort]

        def day(date: str, moved: dict[str, Any] | None = None) -> str:  # what calendar_list(date) shows, in short
            evs = [moved if moved and x["id"] == moved["id"] else x for x in state["calendar"]]
            evs = sorted((x for x in evs if x["date"] == date), key=lambda x: (x["start"], x["id"]))
            return "; ".join(f"{x['id']} {x['start']}-{x['end']} {x['title']}" for x in evs) or "nothing"

        inbox = state["mail"]["inbox"]
        mails = "; ".join(f"{x['id']} {x['from_name']}: {x['subject']}" for x in inbox)
        rest = "the other one needs" if len(inbox) == 2 else f"the other {len(inbox) - 1} need"
        plan = {"move": "list the calendar of the meeting's day and of the day proposed, move that one meeting to the "
                        "first proposed time that is free",
                "cancel": "find that meeting on the calendar and cancel it",
                "doc_reply": "find the document asked about and read the value"}[info["kind"]]
        steps: dict[str, dict[str, Any]] = {
            "inbox": assistant("", T(f"{info['requester']} emailed a request. Plan: list the inbox, read their email, {plan}, "
                                     f"then reply to {first} and to nobody else. No other event, mail or doc may change.",
                                     "Check inbox."), [tool_call("c1", "mail_inbox", {})]),
            "read": assistant("", T(f"Inbox: {mails}. {mid} is "
                                    f"from {info['requester']} <{m['reply_to']}>, the one address the reply goes to; {rest} nothing from me. Read {mid}.",
                                    f"Read {mid}."), [tool_call("c2", "mail_read", {"message_id": mid})]),
        }
        reply_subject = f"Re: {info['subject']}"
        others = len(state["calendar"]) - 1
        if info["kind"] in ("move", "cancel"):
            e = ev[info["event"]]
            dur = minutes(e["end"]) - minutes(e["start"])
            dates = [e["date"]] + ([info["date"]] if info["kind"] == "move" and info["date"] != e["date"] else [])
            calls = [tool_call(f"c3{k}", "calendar_list", {"date": d}) for k, d in enumerate(dates)]
            if info["kind"] == "move":
                d2, t2, t2end = info["date"], info["start"], info["end"]
                alt = f", else {t2}" if "rejected" in info else ""
                first_ask = info.get("rejected", t2)
                look = T(f"{first} asks to move {e['title']} ({weekday(e['date'])} {e['date']} {e['start']}-{e['end']}, {dur} min) "
                         f"to {weekday(d2)} {d2} at {first_ask}{alt}. The new slot needs {dur} free minutes on {d2}. "
                         f"List {e['date']} to find its id.",
                         f"Move {e['title']} to {d2} {first_ask}{alt}.")
                busy = [x for x in state["calendar"] if x["date"] == d2 and x["id"] != e["id"]]
                clash = ""
                if "rejected" in info:
                    r = minutes(info["rejected"])
                    hit = next(x for x in busy if overlaps(x, d2, r, r + dur))
                    clash = f"{info['rejected']}-{hhmm(r + dur)} clashes with {hit['id']} {hit['title']} ({hit['start']}-{hit['end']}); "
                found = f"{e['title']} is {e['id']}. "
                if len(dates) > 1 and mx:  # the other day in a turn of its own
                    steps["look2"] = assistant("", f"{e['date']}: {day(e['date'])}. {found}Now list {d2} for the new slot.", [calls[1]])
                    calls, found = calls[:1], ""
                listed = f"{d2}: {day(d2)}. " if mx else ""
                act = assistant(
                    "",
                    T(f"{listed}{found}{clash}{t2}-{t2end} is free. Move {e['id']}.",
                      f"{e['id']} to {d2} {t2}."),
                    [tool_call("c4", "calendar_move", {"event_id": e["id"], "date": d2, "start": t2})],
                )
                before = [x for x in busy if minutes(x["end"]) <= minutes(t2)]
                after = [x for x in busy if minutes(x["start"]) >= minutes(t2end)]
                near = "".join([f", after {max(before, key=lambda x: x['end'])['id']}" if before else "",
                                f", before {min(after, key=lambda x: x['start'])['id']}" if after else ""])
                gap = [x for x in busy if not (minutes(x["end"]) <= minutes(t2) or minutes(x["start"]) >= minutes(t2end))]
                check = (f"The tool moved {e['id']} to {weekday(d2)} {d2} {t2}-{t2end}, {dur} min as before, with the same "
                         f"attendees. It clashes with {len(gap) or 'none'} of the {len(busy)} other events on {d2} and ends "
                         f"by 18:00. List {d2} again to see it there.", [tool_call("c6", "calendar_list", {"date": d2})],
                         f"{d2} lists {e['id']} at {t2}-{t2end}{near}. Reply to {first}.")
                body = f"Hi {first}, I moved {e['title']} to {weekday(d2)} {d2} at {t2}. Best, Alex"
                final = f"Moved {e['title']} to {weekday(d2)} {d2} at {t2} and replied to {first}."
                outcome = f"{e['id']} is on {d2} at {t2}" + (f", not {info['rejected']}" if "rejected" in info else "")
            else:
                look = T(f"{first} asks to cancel {e['title']} on {weekday(e['date'])} {e['date']}. List {e['date']} to "
                         "find its id; cancel that event only.", f"Cancel {e['title']}.")
                listed = f"{e['date']}: {day(e['date'])}. " if mx else ""
                act = assistant("", T(f"{listed}{e['title']} is {e['id']} ({e['start']}-{e['end']}). Cancel {e['id']} only.",
                                      f"Cancel {e['id']}."), [tool_call("c4", "calendar_cancel", {"event_id": e["id"]})])
                gone = {**e, "date": ""}
                check = (f"The tool cancelled {e['title']} ({e['date']} {e['start']}). List {e['date']} again to see that only "
                         f"{e['id']} is gone.", [tool_call("c6", "calendar_list", {"date": e["date"]})],
                         f"{e['date']} now: {day(e['date'], gone)}. {e['id']} is gone. Reply to {first}.")
                body = f"Hi {first}, I cancelled {e['title']} on {weekday(e['date'])} {e['date']}. Best, Alex"
                final = f"Cancelled {e['title']} and told {first}."
                outcome = f"{e['id']} {e['title']} is cancelled"
            steps["look"] = assistant("", look, calls)
        else:
            field, value, dtitle, did = info["field"], info["value"], info["doc_title"], info["doc"]
            docs = state["docs"]
            steps["look"] = assistant("", T(f"{first} asks for the {field.lower()} in the {dtitle} doc. The value is in the doc, "
                                            "not in the mail. List the docs to find its id.", "List docs."),
                                      [tool_call("c3", "docs_list", {})])
            listed = "Docs: " + "; ".join(f"{d['id']} {d['title']}" for d in docs) + ". " if mx else ""
            act = assistant("", T(f"{listed}{dtitle} is {did}. Open {did} for its {field.lower()} line.", f"Open {did}."),
                            [tool_call("c4", "docs_read", {"doc_id": did})])
            lines = [ln for ln in next(d for d in docs if d["id"] == did)["body"].splitlines() if ln]
            rest = "; ".join(ln for ln in lines if not ln.startswith(f"{field}:"))
            check = (f"{did} says {'; '.join(lines)}. Read {mid} again to be sure which field {first} asked for.",
                     [tool_call("c6", "mail_read", {"message_id": mid})],
                     f"{mid} asks for the {field.lower()}: {value}, not {rest}. Reply to {first}.")
            body = f"Hi {first}, the {field.lower()} in {dtitle} is {value}. Best, Alex"
            final = f"Replied to {first}: {field.lower()} of {dtitle} is {value}."
            outcome = f"the reply gives {value}, the {field.lower()} of {dtitle}"
        steps["act"] = act
        if mx:
            steps["check"] = assistant("", check[0], check[1])
        steps["reply"] = assistant(
            "",
            T(check[2], "Reply."),
            [tool_call("c5", "mail_send", {"to": m["reply_to"], "subject": reply_subject, "body": body})],
        )
        words = " and ".join(" or ".join(g) for g in m["reply_any_of"])
        steps["final"] = assistant(final, T(f"Sent to {m['reply_to']}, the only mail sent; the reply names {words}. Check against the request: {outcome}; "
                                            f"the other {others} events and the docs are unchanged. Done.", ""))
        return steps

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """inbox → read → look (calendar days / docs list) → act (move / cancel / read doc) → reply → final note; at
        ``max`` the second day of a move has its own turn and a check (the day listed again, the request read
        again) comes before the reply."""
        s = self._steps(task, effort)
        return [s[k] for k in ("inbox", "read", "look", "look2", "act", "check", "reply", "final") if k in s]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        """Empty, copied prompt, claims without the work, reply without acting, acting without replying,
        the wrong meeting / value, the clashing slot, the wrong recipient, collateral damage."""
        m = task.metadata
        info = m["info"]
        s = self._steps(task, "low")
        head = [s["inbox"], s["read"], s["look"]]

        def send(to: str, body: str) -> dict[str, Any]:
            return assistant("", "", [tool_call("w5", "mail_send", {"to": to, "subject": f"Re: {info['subject']}", "body": body})])

        reply_body = s["reply"]["tool_calls"][0]["function"]["arguments"]
        body = json.loads(reply_body)["body"]
        out: dict[str, list[dict[str, Any]]] = {
            "empty": [assistant("")],
            "copied_prompt": [assistant(prompt_text(task))],
            "claims_success": [assistant(_CLAIM)],
            "expected_words_only": [s["final"]],
            "action_without_reply": head + [s["act"], s["final"]],
            "wrong_recipient": head + [s["act"], send(info["others"][0], body), s["final"]],
        }
        if info["kind"] != "doc_reply":  # reading a doc changes nothing, so only calendar requests have this one
            out["reply_without_action"] = head + [s["reply"], s["final"]]
        others = sorted(e["id"] for e in m["state"]["calendar"] if e["id"] != info.get("event"))
        if info["kind"] == "move":
            out["wrong_meeting"] = head + [
                assistant("", "", [tool_call("w4", "calendar_move", {"event_id": others[0], "date": info["date"], "start": info["start"]})]),
                s["reply"], s["final"],
            ]
            if "rejected" in info:
                out["clashing_slot"] = head + [
                    assistant("", "", [tool_call("w4", "calendar_move", {"event_id": info["event"], "date": info["date"], "start": info["rejected"]})]),
                    send(m["reply_to"], body.replace(info["start"], info["rejected"])), s["final"],
                ]
        elif info["kind"] == "cancel":
            out["wrong_meeting"] = head + [assistant("", "", [tool_call("w4", "calendar_cancel", {"event_id": others[0]})]), s["reply"], s["final"]]
        elif info["wrong_value"]:
            out["wrong_value"] = head + [s["act"], send(m["reply_to"], body.replace(info["value"], info["wrong_value"])), s["final"]]
        out["collateral_cancel"] = head + [s["act"], s["reply"],
                                           assistant("", "", [tool_call("w6", "calendar_cancel", {"event_id": others[-1]})]), s["final"]]
        return out


def _mentions(text: str, phrase: str) -> bool:
    return phrase.lower() in text.lower()


@register_verifier("agents.assistant")
def verify_assistant(task: Task, final: FinalState) -> Verdict:
    """1.0 iff calendar == expected, a reply to the requester mentions the outcome, no stray mail, docs unchanged."""
    m = task.metadata
    state = final.state if isinstance(final.state, dict) else {}
    cal = sorted(state.get("calendar", []), key=lambda e: e.get("id", ""))
    calendar_ok = cal == m["expected_calendar"]
    sent = state.get("mail", {}).get("sent", [])
    to_req = [x for x in sent if x["to"].strip().lower() == m["reply_to"]]
    stray = [x for x in sent if x["to"].strip().lower() != m["reply_to"]]

    def good(x: dict[str, Any]) -> bool:
        text = f"{x['subject']}\n{x['body']}"
        return all(any(_mentions(text, alt) for alt in group) for group in m["reply_any_of"]) and not any(
            _mentions(x["body"], bad) for bad in m["reply_none_of"]
        )

    reply_ok = any(good(x) for x in to_req)
    docs_ok = state.get("docs") == m["state"]["docs"]
    comps = {"calendar": float(calendar_ok), "reply": float(reply_ok), "no_stray_mail": float(not stray), "docs_unchanged": float(docs_ok)}
    ok = all(v == 1.0 for v in comps.values())
    diag = "" if ok else (
        f"calendar {'ok' if calendar_ok else 'differs from expected'}; replies to requester: {len(to_req)} "
        f"(good: {reply_ok}); stray mails: {[x['to'] for x in stray]}; docs {'unchanged' if docs_ok else 'changed'}"
    )
    return Verdict(float(ok), comps, diag)


SEARCH = register_family(SearchFamily())
ASSISTANT = register_family(AssistantFamily())
