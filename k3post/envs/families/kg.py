"""A small seeded knowledge graph of fictional entities, its document corpus and a BM25 search.

The graph has five entity types and seven functional relations (each subject has exactly one
object, so every multi-hop question has one answer):

    person     --born_in-->     city          company    --founded_by--> person
    person     --studied_at-->  university    company    --hq-->         city
    person     --works_at-->    company       university --located_in--> city
    city       --in_country-->  country

The corpus has one short document per entity (countries included); a document states the
entity's outgoing relations, so following a chain of k relations means opening k documents.
`search` ranks documents with BM25 (title counted twice) and returns the top hits as
``id | title | first sentence`` lines.

Everything is plain JSON (`KnowledgeGraph.to_dict`), so the graph and corpus travel in a task's
metadata.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from k3post.envs.families.common import lexicon_words

__all__ = ["RELATIONS", "CHAINS", "Chain", "KnowledgeGraph", "build_graph", "bm25_search", "tokenize"]

RELATIONS: dict[str, tuple[str, str]] = {
    "born_in": ("person", "city"),
    "studied_at": ("person", "university"),
    "works_at": ("person", "company"),
    "founded_by": ("company", "person"),
    "hq": ("company", "city"),
    "located_in": ("university", "city"),
    "in_country": ("city", "country"),
}
"""relation → (subject type, object type)."""

_PHRASE = {
    "born_in": "birthplace",
    "studied_at": "university",
    "works_at": "employer",
    "founded_by": "founder",
    "hq": "headquarters city",
    "located_in": "city",
    "in_country": "country",
}


@dataclass(frozen=True)
class Chain:
    """A question template: a start type, a relation chain and the question text (``{x}`` = start)."""

    start: str
    relations: tuple[str, ...]
    question: str


CHAINS: tuple[Chain, ...] = (
    Chain("company", ("founded_by", "born_in"), "In which city was the founder of {x} born?"),
    Chain("company", ("founded_by", "studied_at"), "Which university did the founder of {x} attend?"),
    Chain("person", ("works_at", "hq"), "In which city is the employer of {x} headquartered?"),
    Chain("person", ("studied_at", "located_in"), "In which city is the university that {x} attended?"),
    Chain("person", ("born_in", "in_country"), "In which country was {x} born?"),
    Chain("company", ("hq", "in_country"), "In which country is {x} headquartered?"),
    Chain("company", ("founded_by", "born_in", "in_country"), "In which country was the founder of {x} born?"),
    Chain("person", ("works_at", "founded_by", "born_in"), "In which city was the founder of {x}'s employer born?"),
    Chain("person", ("works_at", "hq", "in_country"), "In which country is the employer of {x} headquartered?"),
    Chain("person", ("studied_at", "located_in", "in_country"), "In which country is the university that {x} attended?"),
)
"""Two-hop and three-hop question templates."""

_SYL = ["bra", "cor", "del", "fen", "gar", "hol", "ix", "jas", "kel", "lum", "mor", "nav", "ost", "pel", "quor",
        "ras", "sev", "tam", "ul", "vor", "wen", "yar", "zel", "an", "dru", "eth", "ka", "lin", "mir", "tov"]
_FIRST = ["Ilsa", "Doran", "Mirel", "Tovin", "Saska", "Bren", "Calla", "Edric", "Farah", "Goran", "Hesta", "Ivo",
          "Jessa", "Kestrel", "Lio", "Marta", "Nerin", "Orla", "Pavo", "Runa"]
_COMPANY = ["Labs", "Works", "Systems", "Foods", "Motors", "Textiles", "Robotics", "Press"]
_JOBS = ["engineer", "chemist", "designer", "economist", "pilot", "architect", "botanist", "historian"]
_INDUSTRY = {"Labs": "research", "Works": "steel", "Systems": "software", "Foods": "food", "Motors": "car",
             "Textiles": "textile", "Robotics": "robotics", "Press": "publishing"}


def lexicon() -> tuple[str, ...]:
    """The words the knowledge graphs' names and sentences are made of (syllables lower-case and
    capitalised, first names, company suffixes, jobs, place kinds, relation phrases): the tokenizer's lexicon
    (`k3post.tokenizer.lexicon_corpus`), so an entity name is a few tokens and copying it is a short step."""
    return lexicon_words(_SYL, *_FIRST, *_COMPANY, *_JOBS, *_INDUSTRY.values(), "University", "Institute", "College",
                         "city", "country", "company", *_PHRASE.values())

_TOKEN_RE = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens."""
    return _TOKEN_RE.findall(text.lower())


@dataclass
class KnowledgeGraph:
    """Entities (id → {"type", "name", "attrs"}), relation edges (subject id → {relation: object id}) and documents."""

    entities: dict[str, dict[str, Any]]
    edges: dict[str, dict[str, str]]
    docs: dict[str, dict[str, str]]  # doc id → {"entity", "title", "text"}

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"entities": self.entities, "edges": self.edges, "docs": self.docs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KnowledgeGraph":
        """Inverse of `to_dict`."""
        return cls(dict(data["entities"]), dict(data["edges"]), dict(data["docs"]))

    def name(self, eid: str) -> str:
        """Display name of an entity."""
        return self.entities[eid]["name"]

    def doc_of(self, eid: str) -> str:
        """The id of the document about entity ``eid``."""
        for did, d in self.docs.items():
            if d["entity"] == eid:
                return did
        raise KeyError(eid)

    def follow(self, start: str, relations: tuple[str, ...] | list[str]) -> list[str]:
        """Entity ids along the chain: ``[start, hop1, ..., answer]``."""
        path = [start]
        for r in relations:
            path.append(self.edges[path[-1]][r])
        return path

    def sentence(self, subject: str, relation: str) -> str:
        """The sentence of ``subject``'s document that states ``relation``."""
        return _sentence(self.name(subject), relation, self.name(self.edges[subject][relation]))


def _sentence(s: str, relation: str, o: str) -> str:
    return {
        "born_in": f"{s} was born in {o}.",
        "studied_at": f"{s} studied at {o}.",
        "works_at": f"{s} works at {o}.",
        "founded_by": f"{s} was founded by {o}.",
        "hq": f"{s} is headquartered in {o}.",
        "located_in": f"{s} is located in {o}.",
        "in_country": f"{s} is a city in {o}.",
    }[relation]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def relation_phrase(relation: str) -> str:
    """A short noun for a relation (``founded_by`` → ``founder``)."""
    return _PHRASE[relation]


def build_graph(rng: random.Random, size: int = 1) -> KnowledgeGraph:
    """A random graph; ``size`` (1..3) scales the number of entities (about 15 / 22 / 30 documents)."""
    if size not in (1, 2, 3):
        raise ValueError(f"graph size must be 1, 2 or 3, got {size!r}")
    counts = {"country": size + 1, "city": 2 * size + 2, "university": size + 1, "company": size + 2, "person": 2 * size + 3}
    used: set[str] = set()

    def word(n: int) -> str:
        while True:
            w = "".join(rng.choice(_SYL) for _ in range(n)).capitalize()
            if w not in used and len(w) > 3:
                used.add(w)
                return w

    entities: dict[str, dict[str, Any]] = {}
    ids: dict[str, list[str]] = {t: [] for t in counts}
    firsts = rng.sample(_FIRST, counts["person"])
    suffixes = _COMPANY[:]
    for t, n in counts.items():
        for k in range(n):
            eid = f"{t[:3]}{k}"
            if t == "person":
                name, attrs = f"{firsts[k]} {word(2)}", {"job": rng.choice(_JOBS)}
            elif t == "company":
                suf = rng.choice(suffixes)
                name, attrs = f"{word(2)} {suf}", {"industry": _INDUSTRY[suf]}
            elif t == "university":
                name, attrs = f"{word(2)} {rng.choice(['University', 'Institute', 'College'])}", {}
            else:
                name, attrs = word(rng.choice((2, 3))), {}
            entities[eid] = {"type": t, "name": name, "attrs": attrs}
            ids[t].append(eid)
    edges: dict[str, dict[str, str]] = {eid: {} for eid in entities}
    countries = ids["country"]
    for k, c in enumerate(ids["city"]):  # every country gets a city
        edges[c]["in_country"] = countries[k] if k < len(countries) else rng.choice(countries)
    for u in ids["university"]:
        edges[u]["located_in"] = rng.choice(ids["city"])
    founders = rng.sample(ids["person"], len(ids["company"]))
    for c, p in zip(ids["company"], founders):
        edges[c]["founded_by"] = p
        edges[c]["hq"] = rng.choice(ids["city"])
    for p in ids["person"]:
        edges[p]["born_in"] = rng.choice(ids["city"])
        edges[p]["studied_at"] = rng.choice(ids["university"])
        edges[p]["works_at"] = rng.choice(ids["company"])

    order = list(entities)
    rng.shuffle(order)
    docs: dict[str, dict[str, str]] = {}
    for k, eid in enumerate(order):
        e = entities[eid]
        name = e["name"]
        if e["type"] == "person":
            lead = f"{name} is {_a(e['attrs']['job'])}."
        elif e["type"] == "company":
            lead = f"{name} is {_a(e['attrs']['industry'])} company."
        elif e["type"] == "university":
            lead = f"{name} is a university."
        elif e["type"] == "city":
            lead = ""
        else:
            cities = sorted(entities[c]["name"] for c in ids["city"] if edges[c]["in_country"] == eid)
            lead = f"{name} is a country." + (f" Its cities include {', '.join(cities)}." if cities else "")
        rels = [_sentence(name, r, entities[o]["name"]) for r, o in edges[eid].items()]
        text = " ".join(s for s in [lead, *rels] if s)
        docs[f"d{k + 1:02d}"] = {"entity": eid, "title": name, "text": text}
    return KnowledgeGraph(entities, edges, docs)


def bm25_search(docs: dict[str, dict[str, str]], query: str, k: int = 3, *, k1: float = 1.5, b: float = 0.75) -> list[tuple[str, float]]:
    """Top-``k`` ``(doc id, score)`` by BM25 over title (counted twice) + text; ties by doc id.

    Documents that share no token with the query are not returned.
    """
    q = tokenize(query)
    if not q:
        raise ValueError("the search query has no words")
    toks = {d: tokenize(v["title"]) * 2 + tokenize(v["text"]) for d, v in docs.items()}
    n = len(toks)
    avg = sum(len(t) for t in toks.values()) / max(n, 1)
    df: Counter[str] = Counter()
    for t in toks.values():
        df.update(set(t))
    scores = []
    for d, t in toks.items():
        tf = Counter(t)
        s = 0.0
        for w in set(q):
            if tf[w] == 0:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            s += idf * tf[w] * (k1 + 1) / (tf[w] + k1 * (1 - b + b * len(t) / avg))
        if s > 0:
            scores.append((d, s))
    scores.sort(key=lambda x: (-x[1], x[0]))
    return scores[:k]


def first_sentence(text: str) -> str:
    """The first sentence of a document (its search snippet)."""
    m = re.search(r"[.!?](\s|$)", text)
    return text[: m.end()].strip() if m else text
