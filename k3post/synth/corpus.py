"""Stage 0's pretraining corpus: plain text from the families' own worlds, written so that reading back pays.

Nothing is downloaded. A document is a run of segments drawn from the worlds the task families use
(`k3post.envs.families.kg` knowledge-graph documents and the questions their facts answer, entity fact
records, tool-result-like JSON records, code with its tests, tables, arithmetic), and most of what a segment
introduces — a name, an identifier, a value — is restated later in the same document, after other segments
(`recall`; a roster of names is listed again in order), so predicting the restatement means attending back and copying:

    The badge of Kelmor is Vorwen.   ...   {"id": "r417", "name": "Lumtam", "score": 58} ...
    def fenras_total(xs): ...   assert fenras_total([3, 4]) == 7   ...   Again: the badge of Kelmor is Vorwen.

Names are capitalised runs of 2–3 syllables of the knowledge graphs' syllables (`kg._SYL`, the families'
entity names are made of them). A fixed share of those names is *held out* (`is_held_out`): the generator
never writes one, knowledge-graph documents holding one are skipped, and the copy probe
(`k3post.stages.pretrain.copy_probe`) restates only held-out names, so it measures copying, not memory.

A document is a list of text pieces; every name is a piece of its own (its spaces in the pieces around it), so a name
tokenizes the same wherever it stands (`encode_pieces`), in training and in the probe.

`CORPUS_VERSION` is part of a pretrained base's cache key (`k3post.stages.pretrain.base_key`): bump it whenever the
documents this module writes for a seed change.
"""

from __future__ import annotations

import functools
import json
import random
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from k3post.data import Sample
from k3post.envs.families.kg import _PHRASE, _SYL, build_graph

__all__ = ["CORPUS_VERSION", "SYLLABLES", "is_held_out", "held_out_names", "draw_name", "generate_document",
           "generate_corpus", "document_text", "encode_pieces", "KEYS", "OWNERS_KIND", "record_pieces", "induction_samples"]

CORPUS_VERSION = 1
SYLLABLES: tuple[str, ...] = tuple(_SYL)
_HELD_OUT_MOD = 8  # one name in 8 is held out

KEYS = ("badge", "code name", "password", "mentor", "rival", "partner", "call sign", "supplier", "tutor", "owner")
"""Fact keys of the entity records ("The <key> of <owner> is <Name>.")."""
OWNERS_KIND = ("the lab", "the ship", "the station", "the archive", "the mill", "the bridge", "the garden", "the depot")
_VERBS = ("total", "count", "scale", "shift", "pick", "merge")
_COLS = ("city", "score", "level", "team")


def is_held_out(name: str) -> bool:
    """True for the 2–3-syllable names the corpus never writes (one in `_HELD_OUT_MOD`, by a hash of the name;
    `held_out_names` lists them)."""
    return zlib.crc32(name.encode()) % _HELD_OUT_MOD == 0


def _all_names() -> list[str]:
    out = []
    for a in SYLLABLES:
        for b in SYLLABLES:
            out.append((a + b).capitalize())
            out.extend((a + b + c).capitalize() for c in SYLLABLES)
    return sorted(set(out))


def held_out_names() -> list[str]:
    """Every held-out 2–3-syllable name, sorted."""
    return [n for n in _all_names() if is_held_out(n)]


def draw_name(rng: random.Random) -> str:
    """A capitalised name of 2–3 syllables that is not held out."""
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if not is_held_out(name):
            return name


_WORD = re.compile(r"[A-Za-z]+")
_NAME = re.compile("(?:%s)(?:%s){1,2}" % ("|".join(x.capitalize() for x in SYLLABLES), "|".join(SYLLABLES)))
"""A 2–3-syllable name (a piece of a document that is one)."""


@functools.lru_cache(maxsize=1)
def _held_out_set() -> frozenset[str]:
    return frozenset(held_out_names())


def _has_held_out(text: str) -> bool:
    return any(w in _held_out_set() for w in _WORD.findall(text))


# A segment: (pieces it writes now, recalls it offers: each a list of pieces restating something it wrote).
Segment = tuple[list[str], list[list[str]]]


def record_pieces(key: str, owner: str, name: str, again: bool = False) -> list[str]:
    """The entity-fact sentence "The <key> of <owner> is <Name>." (``again``: its restatement) as pieces."""
    return [("Again: the" if again else "The") + f" {key} of ", owner, " is ", name, ".\n"]


def _facts(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    owner = draw(rng)
    keys = rng.sample(KEYS, rng.randint(1, 3))
    pieces: list[str] = []
    recalls = []
    for k in keys:
        name = draw(rng)
        pieces += record_pieces(k, owner, name)
        recalls.append(record_pieces(k, owner, name, again=True))
    return pieces, recalls


def _tool(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    rid, name, score = f"r{rng.randint(100, 999)}", draw(rng), rng.randint(1, 99)
    pieces = [f'call search(query="{rng.choice(_COLS)}")\nresult: {{"id": "{rid}", "score": {score}, "name": ', name,
              "}\n"]
    recalls = [[f"open({rid}) returned ", name, f" with score {score}.\n"],
               [f"The record {rid} is ", name, ".\n"]]
    return pieces, recalls


def _code(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    fn = f"{draw(rng).lower()}_{rng.choice(_VERBS)}"
    k = rng.randint(1, 9)
    xs = [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]
    pieces = [f"def {fn}(xs):\n    return [x + {k} for x in xs]\n\n",
              f"assert {fn}({xs}) == {[x + k for x in xs]}\n"]
    recalls = [[f"print({fn}({xs[:1]}))  # {[xs[0] + k]}\n"]]
    return pieces, recalls


def _table(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    col = rng.choice(_COLS)
    rows = [(draw(rng), draw(rng) if col in ("city", "team") else str(rng.randint(1, 999))) for _ in range(rng.randint(2, 4))]
    pieces = [f"| name | {col} |\n"]
    for a, b in rows:
        pieces += ["| ", a, " | ", b, " |\n"]
    recalls = [[f"The {col} of ", a, " is ", b, ".\n"] for a, b in rows]
    return pieces, recalls


def _numbers(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    var = draw(rng).lower()
    return [f"{var} = {a} + {b} = {a + b}\n"], [[f"We had {var} = {a + b}.\n"]]


def _kg(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    g = build_graph(random.Random(rng.random()), size=rng.choice((1, 2, 3)))
    docs = [d for d in g.docs.values() if not _has_held_out(d["text"])]
    picked = rng.sample(docs, min(len(docs), rng.randint(1, 3)))
    pieces = [f"{d['title']}: {d['text']}\n" for d in picked]
    recalls = []
    for d in picked:
        for rel, obj in g.edges[d["entity"]].items():
            subj, o = g.name(d["entity"]), g.name(obj)
            recalls.append([f"Q: What is the {_PHRASE[rel]} of {subj}? A: {o}.\n"])
    return pieces, recalls


def _roster(rng: random.Random, draw: Callable[[random.Random], str]) -> Segment:
    names = [draw(rng) for _ in range(rng.randint(3, 6))]
    what = rng.choice(("Roster", "Guests", "Crew", "Suppliers"))
    listed: list[str] = [f"{what}: "]
    for k, n in enumerate(names):
        listed += [n, ", " if k < len(names) - 1 else ".\n"]
    return listed, [[f"{what} again: ", *listed[1:]]]


_SEGMENTS: tuple[tuple[Callable[..., Segment], float], ...] = (
    (_facts, 4.0), (_roster, 2.0), (_tool, 1.5), (_code, 1.5), (_table, 1.5), (_numbers, 0.5), (_kg, 1.0))


def restate(pieces: list[str], rng: random.Random, draw: Callable[[random.Random], str]) -> list[str]:
    """A restatement as written: as recorded (the seam a test plants a bug in: fresh names instead)."""
    return pieces


def _pick_pending(n: int, rng: random.Random, recent_share: float) -> int:
    """Which of ``n`` pending restatements (oldest first) comes next: with probability ``recent_share`` a recent
    one (the k-th newest with probability 2^-(k+1), so the copy is a segment or two back), else any, uniformly."""
    if recent_share > 0 and rng.random() < recent_share:
        k = 0
        while k < n - 1 and rng.random() < 0.5:
            k += 1
        return n - 1 - k
    return rng.randrange(n)


def generate_document(rng: random.Random, n_chars: int, *, draw: Callable[[random.Random], str] = draw_name,
                      recall_share: float = 0.45, recent_share: float = 0.0) -> list[str]:
    """One document of about ``n_chars`` characters as text pieces (module doc): segments, and, with
    probability ``recall_share`` at each turn once something was introduced, a restatement of something
    introduced earlier in the document (each restated at most once; which one: `_pick_pending`, short
    distances with probability ``recent_share``)."""
    pieces: list[str] = []
    pending: list[list[str]] = []
    size = 0
    fns, weights = zip(*_SEGMENTS)
    while size < n_chars:
        if pending and rng.random() < recall_share:
            new = restate(pending.pop(_pick_pending(len(pending), rng, recent_share)), rng, draw)
        else:
            fn = rng.choices(fns, weights)[0]
            new, recalls = fn(rng, draw)
            pending += recalls
        pieces += new
        size += sum(len(p) for p in new)
    return pieces


def generate_corpus(n_docs: int, seed: int, n_chars: int, **kw: Any) -> list[list[str]]:
    """``n_docs`` documents (`generate_document`), a pure function of the arguments."""
    rng = random.Random(f"k3post-corpus|{CORPUS_VERSION}|{seed}")
    return [generate_document(rng, n_chars, **kw) for _ in range(n_docs)]


def document_text(pieces: Sequence[str]) -> str:
    return "".join(pieces)


def encode_pieces(tokenizer: Any, pieces: Sequence[str]) -> list[int]:
    """Token ids of a document: every piece encoded on its own (`k3post.tokenizer.encode_text`), concatenated."""
    from k3post.tokenizer import _text_backend, encode_text

    backend = _text_backend(tokenizer)
    if backend is None:
        return [i for p in pieces for i in encode_text(tokenizer, p)]
    return [i for enc in backend.encode_batch([p for p in pieces if p], add_special_tokens=False) for i in enc.ids]


def corpus_json(docs: Sequence[Sequence[str]]) -> str:
    """The documents as JSON lines (one list of pieces per line)."""
    return "".join(json.dumps(list(d)) + "\n" for d in docs)


# =========================================================================== induction rows (stage 0, SFT replay)


def _induction_rows(tokenizer: Any, n: int, seq_len: int, key: str) -> list[tuple[list[int], int]]:
    """(ids, period) of ``n`` induction rows (`induction_samples`), drawn from ``random.Random(key)``."""
    nl = encode_pieces(tokenizer, ["\n"])
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(nl)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(key)
    out = []
    for _ in range(n):
        span = [rng.choice(pool) for _ in range(rng.randint(8, 30))] + nl
        out.append(((span * (seq_len // len(span) + 1))[:seq_len], len(span)))
    return out


def induction_samples(tokenizer: Any, n: int, seq_len: int, seed: int) -> list[Sample]:
    """``n`` rows of ``seq_len`` tokens, each a span of 8–30 tokens drawn uniformly from the tokenizer's ordinary
    ids, repeated (a newline between repeats) until the row is full. From the first repeat on every token is
    predictable only by finding where the token before it stood earlier in the row and copying the one that
    followed: the induction pattern, over tokens the corpus may never put side by side, so what is learnt is
    copying itself (docs/decisions.md, issue 31 §copy)."""
    return [Sample(ids=ids, loss_mask=[True] * seq_len, source=f"induction:{i}")
            for i, (ids, _) in enumerate(_induction_rows(tokenizer, n, seq_len, f"k3post-induction|{seed}"))]
