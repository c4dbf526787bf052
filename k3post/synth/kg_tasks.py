"""Knowledge-graph-guided task synthesis (SPEC §3.5): ``k3post synth-tasks``.

1. **Concept DAG** (`grow_dag`): from seed concepts, coarse → fine. An `Explorer` proposes sub-concepts of a
   node; retrieval grounds each proposal in the corpus (the documents whose words contain it); a proposal
   nothing grounds is dropped, one that is not finer than its parent (its documents are not a subset of the
   parent's) is dropped, one equal to an existing node (same folded label, or the same single document) is
   merged into it (a new edge, no new node), and growth stops at atomic concepts (a document title, or a
   concept grounded in exactly one document) or at ``max_depth``.
   Explorers: `CorpusExplorer` (offline, the default: "X is a/an D." definitions read from the corpus, a
   Hearst-pattern is-a relation) or `EndpointExplorer` (any OpenAI-compatible chat model).
2. **Synthesis** (`synthesize_candidates`): sample node combinations from the DAG, take their labels as
   keywords, retrieve evidence (BM25 over the local corpus, following the entity links of the retrieved
   documents), and write one task of one type: ``multi_hop`` (follow a chain of relations), ``comparison``
   (which of two sibling entities leads to a target) or ``aggregation`` (how many of 2-4 siblings do). Each
   candidate carries a small *program* over facts, so its answer can be recomputed from any set of documents.
3. **Verification funnel** (`verify_candidates`), stops at the first reject, counts per stage and reason:
   ``supported`` (the program run on the evidence documents alone gives the answer, among others at most), ``unique`` (run on the
   whole corpus it gives exactly that one answer), ``multi_doc`` (no single document gives it, none
   names every entity of the question and the answer, and the question does not contain the answer), ``retrievable`` (searching each evidence document's title finds it in the
   top 3, as the search tool shows), ``novel`` (no earlier task with the same question or the same type,
   answer and evidence), ``verifies`` (as an `agents.search` task, its reference solver scores 1).

Facts are ``(subject, predicate, object)`` triples read from the corpus by entity linking: a sentence of the
document titled S that mentions another document's title O gives ``(S, words before the first mention, O)``.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3post.envs.families.common import normalize_answer
from k3post.envs.families.kg import bm25_search, build_graph, first_sentence, tokenize
from k3post.synth.verify import KEEP, REJECT, Funnel, StageResult

__all__ = [
    "TASK_TYPES", "FUNNEL_STAGES", "Concept", "ConceptDAG", "Explorer", "CorpusExplorer", "EndpointExplorer",
    "Fact", "FactStore", "default_corpus", "load_corpus", "ground", "grow_dag", "synthesize_candidates",
    "answers", "verify_candidates", "synth_tasks",
]

Docs = Mapping[str, Mapping[str, str]]  # doc id → {"title", "text", ...}
TASK_TYPES = ("multi_hop", "comparison", "aggregation")
FUNNEL_STAGES = ("supported", "unique", "multi_doc", "retrievable", "novel", "verifies")


# =========================================================================== corpus


def default_corpus(seed: int = 0) -> dict[str, dict[str, str]]:
    """The built-in local corpus: the documents of one seeded knowledge graph of size 3 (~32 documents)."""
    return build_graph(random.Random(f"synth-tasks|{seed}"), size=3).docs


def load_corpus(path: str | Path) -> dict[str, dict[str, str]]:
    """A JSONL corpus, one ``{"id", "title", "text"}`` per line; ids and titles must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: corpus file not found")
    docs: dict[str, dict[str, str]] = {}
    titles: set[str] = set()
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            did, title, text = str(rec["id"]), str(rec["title"]), str(rec["text"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{n}: expected a JSON object with id, title and text ({e})") from None
        if did in docs or title in titles:
            raise ValueError(f"{p}:{n}: duplicate document id or title {did!r} / {title!r}")
        docs[did] = {"title": title, "text": text}
        titles.add(title)
    if len(docs) < 2:
        raise ValueError(f"{p}: the corpus needs at least 2 documents")
    return docs


def _fold(words: Sequence[str]) -> tuple[str, ...]:
    """Plural-folded words without articles: ``"the Software Companies"`` → ``("software", "company")``."""
    out = []
    for w in words:
        if w in ("a", "an", "the"):
            continue
        if len(w) > 4 and w.endswith("ies"):
            w = w[:-3] + "y"
        elif len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return tuple(out)


def _contains(seq: tuple[str, ...], sub: tuple[str, ...]) -> bool:
    n = len(sub)
    return n > 0 and any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


def ground(docs: Docs, label: str) -> list[str]:
    """The retrieval step: a document title grounds to its document; any other label to the documents whose
    (plural-folded) words contain the label's words in order. Sorted doc ids; empty when nothing grounds it."""
    by_title = [d for d, v in docs.items() if v["title"].lower() == label.strip().lower()]
    if by_title:
        return by_title
    want = _fold(tokenize(label))
    if not want:
        return []
    return sorted(d for d, v in docs.items() if _contains(_fold(tokenize(v["title"] + " " + v["text"])), want))


# =========================================================================== concept DAG


@dataclass
class Concept:
    """A DAG node: a label, its depth (seeds are 0), the documents grounding it, and its edges."""

    id: str
    label: str
    depth: int
    docs: list[str]
    atomic: bool
    parents: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)


@dataclass
class ConceptDAG:
    """Concepts by id plus growth counters (merges and dropped proposals)."""

    nodes: dict[str, Concept] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"proposed": 0, "merged": 0, "ungrounded": 0, "not_finer": 0})

    def stats(self) -> dict[str, int]:
        """Size of the DAG: nodes, edges, atomic nodes, seeds, max depth, plus the growth counters."""
        return {"nodes": len(self.nodes), "edges": sum(len(c.children) for c in self.nodes.values()),
                "atomic": sum(c.atomic for c in self.nodes.values()), "seeds": sum(c.depth == 0 for c in self.nodes.values()),
                "max_depth": max((c.depth for c in self.nodes.values()), default=0), **self.counts}

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"stats", "nodes": [...]}``."""
        return {"stats": self.stats(), "nodes": [vars(c) for c in self.nodes.values()]}

    def entity(self, cid: str, docs: Docs) -> str:
        """The entity an atomic concept names: the title of its one document."""
        return docs[self.nodes[cid].docs[0]]["title"]


class Explorer(Protocol):
    """Proposes sub-concepts of a concept, given snippets of the documents that ground it."""

    def propose(self, concept: str, evidence: list[str]) -> list[str]:
        ...


_ISA = re.compile(r"^(?:is|was) (?:a|an) (.+?)\.?$")


class CorpusExplorer:
    """The offline explorer: reads "T is a/an D." sentences (T a document title) as is-a facts.

    Sub-concepts of C are the definitions that contain C's words and are one step finer (``company`` →
    ``software company``; ``city`` → ``city in Xland``), and the titles defined as exactly C (instances).
    `seeds` are the coarsest heads (the definitions' first noun phrase's last word: ``company``, ``city``).
    """

    def __init__(self, docs: Docs) -> None:
        self.isa: dict[str, tuple[str, ...]] = {}  # title → folded definition
        self.label: dict[tuple[str, ...], str] = {}  # folded definition → its text
        for v in docs.values():
            for sent in re.split(r"(?<=\.)\s+", v["text"]):
                if sent.startswith(v["title"] + " "):
                    m = _ISA.match(sent[len(v["title"]) + 1:])
                    if m:
                        key = _fold(tokenize(m.group(1)))
                        self.isa[v["title"]] = key
                        self.label.setdefault(key, m.group(1))
                        break

    def seeds(self) -> list[str]:
        """The head noun of every definition, each once, sorted."""
        heads = {k[: k.index("in")][-1] if "in" in k[1:] else k[-1] for k in self.label}
        return sorted(heads)

    def propose(self, concept: str, evidence: list[str]) -> list[str]:  # noqa: ARG002 - reads its own corpus
        c = _fold(tokenize(concept))
        finer = [k for k in self.label if k != c and _contains(k, c)]
        direct = [k for k in finer if not any(j != k and _contains(k, j) for j in finer)]
        return [self.label[k] for k in sorted(direct)] + sorted(t for t, k in self.isa.items() if k == c)


class EndpointExplorer:
    """An explorer behind an OpenAI-compatible ``/v1/chat/completions`` endpoint: it is shown the concept and
    evidence snippets and answers one sub-concept per line (bullets / numbering stripped). ``propose`` runs its
    own event loop (``asyncio.run``): call it outside a running loop, as `grow_dag` does."""

    PROMPT = ("You build a concept hierarchy over a document collection. Concept: {concept}\n"
              "Evidence from the collection:\n{evidence}\n"
              "List up to {k} finer sub-concepts or named instances of this concept that the evidence mentions, "
              "one per line, nothing else. Answer NONE if the concept is atomic.")

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, max_children: int = 8,
                 timeout_s: float = 60.0, transport: Any = None) -> None:
        from k3post.envs.episode import OpenAIPolicy

        self.policy = OpenAIPolicy(base_url, model, api_key, temperature=0.0, timeout_s=timeout_s, transport=transport)
        self.max_children = max_children

    def propose(self, concept: str, evidence: list[str]) -> list[str]:
        prompt = self.PROMPT.format(concept=concept, evidence="\n".join(f"- {e}" for e in evidence), k=self.max_children)
        msg = asyncio.run(self.policy([{"role": "user", "content": prompt}], []))
        out = []
        for line in str(msg.get("content", "")).splitlines():
            line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip().strip('"')
            if line and line.upper() != "NONE":
                out.append(line)
        return out


def _is_ancestor(dag: ConceptDAG, a: str, b: str) -> bool:
    """Whether ``a`` is ``b`` or one of its ancestors."""
    todo, seen = [b], set()
    while todo:
        x = todo.pop()
        if x == a:
            return True
        if x not in seen:
            seen.add(x)
            todo += dag.nodes[x].parents
    return False


def grow_dag(docs: Docs, seeds: Sequence[str], explorer: Explorer, *, max_depth: int = 4, max_nodes: int = 500,
             max_children: int = 12, evidence_docs: int = 6) -> ConceptDAG:
    """Grow the concept DAG breadth-first (coarse → fine) from ``seeds``; see the module docstring for the rules."""
    dag = ConceptDAG()
    index: dict[Any, str] = {}  # dedup key → concept id

    def key(label: str, grounded: list[str], atomic: bool) -> Any:
        return ("doc", grounded[0]) if atomic else ("label", _fold(tokenize(label)))

    def add(label: str, grounded: list[str], depth: int, parent: str | None) -> str:
        atomic = len(grounded) == 1
        k = key(label, grounded, atomic)
        if k in index:
            cid = index[k]
            if parent is not None and parent not in dag.nodes[cid].parents and not _is_ancestor(dag, cid, parent):
                dag.nodes[cid].parents.append(parent)
                dag.nodes[parent].children.append(cid)
            dag.counts["merged"] += 1
            return cid
        cid = f"c{len(dag.nodes):04d}"
        dag.nodes[cid] = Concept(cid, label, depth, grounded, atomic, [parent] if parent else [])
        if parent is not None:
            dag.nodes[parent].children.append(cid)
        index[k] = cid
        return cid

    frontier = []
    for s in seeds:
        g = ground(docs, s)
        if not g:
            raise ValueError(f"seed concept {s!r}: no document of the corpus contains it")
        frontier.append(add(s, g, 0, None))
    frontier = list(dict.fromkeys(frontier))
    while frontier:
        nxt: list[str] = []
        for cid in frontier:
            node = dag.nodes[cid]
            if node.atomic or node.depth >= max_depth:
                continue
            evidence = [f"{docs[d]['title']}: {first_sentence(docs[d]['text'])}" for d in node.docs[:evidence_docs]]
            for label in explorer.propose(node.label, evidence)[:max_children]:
                if len(dag.nodes) >= max_nodes:
                    return dag
                dag.counts["proposed"] += 1
                g = ground(docs, label)
                if not g:
                    dag.counts["ungrounded"] += 1
                    continue
                if not set(g) <= set(node.docs) or g == node.docs:
                    dag.counts["not_finer"] += 1
                    continue
                n_before = len(dag.nodes)
                child = add(label, g, node.depth + 1, cid)
                if len(dag.nodes) > n_before:
                    nxt.append(child)
        frontier = nxt
    return dag


# =========================================================================== facts and programs


@dataclass(frozen=True)
class Fact:
    """``subject predicate object``, read from document ``doc``."""

    subject: str
    predicate: str
    obj: str
    doc: str


def _mention_re(docs: Docs) -> re.Pattern[str]:
    titles = sorted((v["title"] for v in docs.values()), key=len, reverse=True)
    return re.compile(r"\b(" + "|".join(re.escape(t) for t in titles) + r")\b")


def _mentions(docs: Docs, text: str) -> list[str]:
    """The document titles ``text`` mentions (longest match first), in order."""
    return [m.group(0) for m in _mention_re(docs).finditer(text)]


def extract_facts(docs: Docs) -> list[Fact]:
    """Entity-linked triples of every document (see the module docstring)."""
    mention = _mention_re(docs)
    facts = []
    for did in sorted(docs):
        title, text = docs[did]["title"], docs[did]["text"]
        for sent in re.split(r"(?<=\.)\s+", text):
            ms = [m for m in mention.finditer(sent) if m.group(0) != title]
            if not ms:
                continue
            head = sent[: ms[0].start()]
            head = head[len(title):] if head.startswith(title) else head
            pred = " ".join(tokenize(head))
            if pred:
                facts += [Fact(title, pred, m.group(0), did) for m in ms]
    return facts


class FactStore:
    """Facts indexed by (subject, predicate)."""

    def __init__(self, facts: Sequence[Fact]) -> None:
        self.facts = list(facts)
        self.index: dict[tuple[str, str], set[str]] = defaultdict(set)
        for f in facts:
            self.index[(f.subject, f.predicate)].add(f.obj)

    def preds(self, subject: str) -> list[str]:
        """Predicates with ``subject``, sorted."""
        return sorted({p for s, p in self.index if s == subject})

    def chain(self, start: str, preds: Sequence[str]) -> set[str]:
        """Objects reached from ``start`` along ``preds`` (empty when a hop is unknown)."""
        frontier = {start}
        for p in preds:
            frontier = set().union(*(self.index.get((x, p), set()) for x in frontier))
        return frontier

    def restrict(self, doc_ids: Sequence[str]) -> "FactStore":
        """The facts read from ``doc_ids`` only."""
        keep = set(doc_ids)
        return FactStore([f for f in self.facts if f.doc in keep])


def answers(program: Mapping[str, Any], store: FactStore) -> set[str]:
    """Every answer ``store`` supports for ``program`` (one: answerable; none: unknown; several: ambiguous).

    multi_hop: the objects reached from ``start`` along ``preds``. comparison: the items whose chain reaches
    ``target`` (the question promises one). aggregation: the possible counts of items whose chain reaches
    ``target`` (from the items that surely do to those that may); unknown unless every item's chain resolves.
    """
    kind, preds = program["type"], program["preds"]
    if kind == "multi_hop":
        return store.chain(program["start"], preds)
    chains = {it: store.chain(it, preds) for it in program["items"]}
    if kind == "comparison":
        return {it for it, objs in chains.items() if program["target"] in objs}
    if kind == "aggregation":
        if any(not objs for objs in chains.values()):
            return set()
        sure = sum(objs == {program["target"]} for objs in chains.values())
        may = sum(program["target"] in objs for objs in chains.values())
        return {str(c) for c in range(sure, may + 1)}
    raise ValueError(f"unknown task type {kind!r}; expected one of {TASK_TYPES}")


# =========================================================================== synthesis


def _retrieve(docs: Docs, name: str) -> str | None:
    """The document titled ``name`` if a keyword search for it returns it (top 3)."""
    return next((d for d, _ in bm25_search(docs, name, k=3) if docs[d]["title"] == name), None)


def _walk(docs: Docs, store: FactStore, start: str, hops: int, rng: random.Random) -> tuple[list[str], list[str], list[str]] | None:
    """A random chain of ``hops`` relations from ``start``, following retrieved documents only:
    ``(preds, entities along it, evidence doc ids)``, or None when a hop has no single next entity."""
    preds, path, evidence = [], [start], []
    for _ in range(hops):
        did = _retrieve(docs, path[-1])
        if did is None:
            return None
        evidence.append(did)
        local = store.restrict([did])
        # one next entity, not one already on the path (a city → its country → its cities → the same city)
        options = [p for p in local.preds(path[-1]) if len(local.chain(path[-1], [p])) == 1
                   and not local.chain(path[-1], [p]) & set(path)]
        if not options:
            return None
        p = rng.choice(options)
        preds.append(p)
        path.append(next(iter(local.chain(path[-1], [p]))))
    return preds, path, evidence


def _names(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _relative(preds: Sequence[str], target: str) -> str:
    """``[was founded by, was born in], Mora`` → ``was founded by an entity that was born in Mora``."""
    return " an entity that ".join(preds) + f" {target}"


def synthesize_candidates(docs: Docs, dag: ConceptDAG, n: int, *, seed: int = 0, max_hops: int = 3) -> list[dict[str, Any]]:
    """``n`` candidate tasks (types cycling through `TASK_TYPES`), each from a sampled node combination."""
    rng = random.Random(f"synth-tasks|candidates|{seed}")
    store = FactStore(extract_facts(docs))
    atomic = sorted(c for c, v in dag.nodes.items() if v.atomic)
    groups = sorted(c for c, v in dag.nodes.items() if sum(dag.nodes[k].atomic for k in v.children) >= 2)
    if not atomic:
        raise ValueError("the concept DAG has no atomic concept to build tasks from")
    out: list[dict[str, Any]] = []
    for attempt in range(20 * n + 20):
        if len(out) >= n:
            break
        kind = TASK_TYPES[len(out) % len(TASK_TYPES)]
        hops = rng.randint(1, max_hops)
        if kind == "multi_hop" or not groups:
            kind = "multi_hop"
            combo = [rng.choice(atomic)]
            items = [dag.entity(combo[0], docs)]
        else:
            parent = rng.choice(groups)
            kids = sorted(k for k in dag.nodes[parent].children if dag.nodes[k].atomic)
            combo = [parent] + rng.sample(kids, min(len(kids), 2 if kind == "comparison" else rng.randint(2, 4)))
            items = [dag.entity(c, docs) for c in combo[1:]]
        walk = _walk(docs, store, items[0], hops, rng)
        if walk is None:
            continue
        preds, path, evidence = walk
        if kind == "multi_hop":
            program: dict[str, Any] = {"type": kind, "start": items[0], "preds": preds}
            steps = [f"{items[0]} {preds[0]} X1"] + [f"X{i} {p} X{i + 1}" for i, p in enumerate(preds[1:], 1)]
            question, answer = f"{'. '.join(steps)}. What is X{len(preds)}? Answer with its name only.", path[-1]
        else:
            target = path[-1]
            program = {"type": kind, "items": items, "preds": preds, "target": target}
            for it in items[1:]:  # the other items' evidence: their chains, through retrieved documents
                for d in _chain_docs(docs, store, it, preds):
                    evidence.append(d)
            rel = _relative(preds, target)
            if kind == "comparison":
                question, answer = f"Of {_names(items)}, which one {rel}? Answer with its name only.", items[0]
            else:
                matches = sum(target in store.restrict(evidence).chain(it, preds) for it in items)
                question, answer = f"Of {_names(items)}, how many {rel}? Answer with a number.", str(matches)
        out.append({"id": f"kg-{seed}-{attempt:05d}", "type": kind, "question": question, "answer": answer,
                    "program": program, "evidence": list(dict.fromkeys(evidence)),
                    "concepts": combo, "keywords": [dag.nodes[c].label for c in combo]})
    return out


def _chain_docs(docs: Docs, store: FactStore, start: str, preds: Sequence[str]) -> list[str]:
    """The retrieved documents read while following ``preds`` from ``start`` (stops where a hop is unknown)."""
    out, frontier = [], [start]
    for p in preds:
        nxt = []
        for x in frontier:
            did = _retrieve(docs, x)
            if did is not None:
                out.append(did)
                nxt += sorted(store.restrict([did]).chain(x, [p]))
        frontier = nxt
    return out


# =========================================================================== verification funnel


def _stage_supported(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    got = answers(c["program"], store.restrict(c["evidence"]))
    if c["answer"] not in got:  # several answers: left to the `unique` stage
        return StageResult(REJECT, "unsupported", f"the evidence {c['evidence']} gives {sorted(got)}, not {c['answer']!r}")
    return StageResult(KEEP)


def _stage_unique(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    got = answers(c["program"], store)
    if got != {c["answer"]}:
        reason = "ambiguous" if len(got) > 1 else "contradicted"
        return StageResult(REJECT, reason, f"the corpus gives {sorted(got)}")
    return StageResult(KEEP)


def _stage_multi_doc(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    # a comparison names its candidates, so only the other types must not contain their answer
    if c["type"] != "comparison" and f" {normalize_answer(c['answer'])} " in f" {normalize_answer(c['question'])} ":
        return StageResult(REJECT, "answer_in_question", "the question states its answer")
    for did in sorted(docs):
        if answers(c["program"], store.restrict([did])) == {c["answer"]}:
            return StageResult(REJECT, "single_doc", f"{did} alone answers it")
    # facts the programs do not read (a country page listing its cities answers "how many of A, B are cities
    # of X"): a document that names every entity of the question, and the answer, may answer it alone
    named = set(_mentions(docs, c["question"])) | ({c["answer"]} & {v["title"] for v in docs.values()})
    if len(named) >= 2:
        for did in sorted(docs):
            if named <= set(_mentions(docs, docs[did]["text"])) | {docs[did]["title"]}:
                return StageResult(REJECT, "one_doc_names_all", f"{did} names {sorted(named)}")
    return StageResult(KEEP)


def _stage_retrievable(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    for did in c["evidence"]:
        if _retrieve(docs, docs[did]["title"]) != did:
            return StageResult(REJECT, "not_retrievable", f"searching {docs[did]['title']!r} does not show {did}")
    return StageResult(KEEP)


def _stage_novel(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    q = " ".join(sorted(set(tokenize(c["question"]))))
    k = json.dumps([c["type"], normalize_answer(c["answer"]), sorted(c["evidence"])])
    if q in seen["questions"] or k in seen["keys"]:
        return StageResult(REJECT, "duplicate", "same question, or same type, answer and evidence as a kept task")
    seen["questions"].add(q)
    seen["keys"].add(k)
    return StageResult(KEEP)


def _stage_verifies(c: Mapping[str, Any], store: FactStore, docs: Docs, seen: dict[str, set]) -> StageResult:
    from k3post.envs.episode import run_episode_sync
    from k3post.envs.families.agents.family import SEARCH

    task = SEARCH.synth_task({**c, "docs": dict(docs)}, str(c["id"]))
    ep = run_episode_sync(SEARCH.reference_policy(task, "low"), SEARCH.make_env(task), task)
    if ep.verdict is None or ep.verdict.reward != 1.0:
        return StageResult(REJECT, "reference_fails", ep.verdict.diagnostics if ep.verdict else f"no verdict (truncation: {ep.truncation})")
    return StageResult(KEEP)


_STAGES = {"supported": _stage_supported, "unique": _stage_unique, "multi_doc": _stage_multi_doc,
           "retrievable": _stage_retrievable, "novel": _stage_novel, "verifies": _stage_verifies}


def verify_candidates(docs: Docs, candidates: Sequence[Mapping[str, Any]], *, existing: Sequence[Mapping[str, Any]] = ()
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Funnel]:
    """Run every candidate through `FUNNEL_STAGES` (stop at the first reject): ``(kept, rejected, funnel)``.
    ``existing`` tasks count for the duplicate check. A rejected record gains ``stage``, ``reason``, ``detail``."""
    store = FactStore(extract_facts(docs))
    funnel = Funnel(FUNNEL_STAGES)
    seen: dict[str, set] = {"questions": set(), "keys": set()}
    for e in existing:
        _stage_novel(e, store, docs, seen)
    kept, rejected = [], []
    for c in candidates:
        for name in FUNNEL_STAGES:
            res = _STAGES[name](c, store, docs, seen)
            funnel.record(name, res)
            if res.status == REJECT:
                rejected.append({**c, "stage": name, "reason": res.reason, "detail": res.detail})
                funnel.finish(REJECT)
                break
        else:
            kept.append(dict(c))
            funnel.finish(KEEP)
    return kept, rejected, funnel


# =========================================================================== the command


def synth_tasks(out_dir: str | Path, *, n: int = 60, seed: int = 0, corpus: str | Path | None = None,
                seeds: Sequence[str] = (), explorer: Explorer | None = None, max_depth: int = 4) -> dict[str, Any]:
    """``k3post synth-tasks``: DAG → candidates → funnel; writes ``kg_dag.json``, ``kg_tasks.jsonl`` (each record
    carries its corpus, so `agents.search` can serve it alone), ``kg_rejected.jsonl`` and ``kg_funnel.json``
    into ``out_dir`` and returns ``{"dag": stats, "funnel": ..., "kept": k}``."""
    docs = load_corpus(corpus) if corpus else default_corpus(seed)
    if explorer is None:
        explorer = CorpusExplorer(docs)
    if not seeds:
        if not isinstance(explorer, CorpusExplorer):
            raise ValueError("give seed concepts (--seeds) with a model explorer")
        seeds = explorer.seeds()
    dag = grow_dag(docs, seeds, explorer, max_depth=max_depth)
    kept, rejected, funnel = verify_candidates(docs, synthesize_candidates(docs, dag, n, seed=seed))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kg_dag.json").write_text(json.dumps(dag.to_dict(), indent=1), encoding="utf-8")
    with open(out / "kg_tasks.jsonl", "w", encoding="utf-8") as f:
        for t in kept:
            f.write(json.dumps({**t, "docs": dict(docs)}, ensure_ascii=False) + "\n")
    with open(out / "kg_rejected.jsonl", "w", encoding="utf-8") as f:
        for t in rejected:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    summary = {"dag": dag.stats(), "funnel": funnel.to_dict(), "kept": len(kept),
               "kept_by_type": {k: sum(t["type"] == k for t in kept) for k in TASK_TYPES}}
    (out / "kg_funnel.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary
