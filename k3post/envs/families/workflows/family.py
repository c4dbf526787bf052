"""Professional workflows (SPEC §3.5, issue 21): ``agents.data_report`` and ``agents.contracts``.

``agents.data_report`` (rule-gated; the narrative's quality for the GRM)
    A sandbox working directory holds generated sales data: ``data/sales.csv`` (region, quarter, revenue,
    cost) at difficulty 1; one row per product at difficulty 2 (aggregate first); revenue in
    ``data/revenue.csv`` and costs in ``data/costs.json`` at difficulty 3 (join first). The agent
    has ``list_files``, ``read_file``, ``write_file`` and ``run_python`` (the sandbox's system Python,
    pandas installed by ``scripts/install_sandbox.sh``) and must write four deliverables:

    * ``out/answer.json``  ``{"region": R, "change_pp": x}``: the region whose margin fell most Q1 → Q2;
    * ``out/report.csv``   columns exactly ``region,q1_margin_pct,q2_margin_pct,change_pp``, one row per
      region, sorted by ``change_pp`` ascending;
    * ``out/chart.json``   ``{"type": "bar", "x": "region", "y": "change_pp", "data": [{region, change_pp}...]}``
      in the report's order;
    * ``out/summary.md``   a narrative of `SUMMARY_WORDS` words that names the region and its change; every
      number in it must be one of the data's values (margins, changes, totals), so an invented figure fails.

    margin_pct = 100 (Σ revenue − Σ cost) / Σ revenue per region and quarter; change_pp = Q2 − Q1. Numbers
    match within `TOL` (0.051: the report's 2 decimals and the summary's 1 decimal both round within it).
    The verifier reads the final files only (`verify_data_report`); the reward is 1 iff every rule holds.
    `k3post.rewards.grm.gated.judged_reward` multiplies that gate by a GRM quality score of the narrative, judging the
    candidate the family declares (`DataReportFamily.grm_candidate`);
    a failed gate is 0 without asking the judge.

``agents.contracts`` (rule: span overlap)
    3-5 generated contracts with numbered clauses (term, payment, two kinds of termination, liability,
    confidentiality, governing law) whose values differ per counterparty. The question needs one clause
    (difficulty 1), two clauses of one contract (2), or a comparison across contracts (3: which contract has
    the longest payment term). Tools ``list_documents``, ``read_document``, ``submit(answer, quotes)``. Reward
    1 iff the answer holds the expected values (and no other contract's value) and the quotes match the gold
    clauses: each quote must occur verbatim in its document (whitespace-normalised; a paraphrase is
    fabricated), and quotes and gold spans pair up with character-span IoU >= `SPAN_IOU` (0.6): every gold
    clause covered, no quote off every gold clause.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from k3post.envs.env import EpisodeLimits, ToolEnvironment
from k3post.envs.families.aet.core import AETState, final_state
from k3post.envs.families.common import FamilyBase, assistant, normalize_answer, prompt_text, tool_call
from k3post.envs.families.registry import register_family
from k3post.envs.sandbox_tools import TOOLS
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = ["DataReportFamily", "ContractsFamily", "SPAN_IOU", "TOL", "report_candidate", "span_iou",
           "verify_data_report", "verify_contracts"]

TOL = 0.051
"""Absolute tolerance on percentages and percentage points (ours)."""
SPAN_IOU = 0.6
"""Minimum character-span IoU between a quote and its gold clause (ours)."""
SUMMARY_WORDS = (15, 120)
REPORT_COLUMNS = ["region", "q1_margin_pct", "q2_margin_pct", "change_pp"]
_CLAIM = "All deliverables are written and checked. The task is complete."

# =========================================================================== data report

_REGIONS = ["North", "South", "East", "West", "Central", "Coastal"]
_PRODUCTS = ["Widgets", "Gadgets", "Tools"]

_SCRIPT = '''import json
import pandas as pd

{load}
g = df.groupby(["region", "quarter"])[["revenue", "cost"]].sum()
g["margin_pct"] = 100 * (g["revenue"] - g["cost"]) / g["revenue"]
m = g["margin_pct"].unstack("quarter")
rep = pd.DataFrame({{"region": m.index, "q1_margin_pct": m["Q1"].round(2).values, "q2_margin_pct": m["Q2"].round(2).values,
                    "change_pp": (m["Q2"] - m["Q1"]).round(2).values}}).sort_values("{sort}").reset_index(drop=True)
{mutate}
import os
os.makedirs("out", exist_ok=True)
rep[{columns}].to_csv("out/report.csv", index=False)
worst = rep.iloc[0]
json.dump({{"region": worst["{pick}"], "change_pp": float(worst["change_pp"])}}, open("out/answer.json", "w"))
json.dump({{"type": "bar", "x": "region", "y": "{y}", "title": "Margin change Q1 to Q2 (pp)",
           "data": [{{"region": r, "{y}": float(v)}} for r, v in zip(rep["region"], rep["{y}"])]}}, open("out/chart.json", "w"))
print(rep.to_string(index=False))
t = g.groupby("quarter")[["revenue", "cost"]].sum()
print("totals", t.to_dict())
'''
_LOAD = {
    1: 'df = pd.read_csv("data/sales.csv")',
    2: 'df = pd.read_csv("data/sales.csv")',
    3: 'df = pd.read_csv("data/revenue.csv").merge(pd.DataFrame(json.load(open("data/costs.json"))), '
       'on=["region", "quarter", "product"])',
}


def _margins(rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(region → {q1, q2, change}) and (quarter → {revenue, cost} totals) of the sales rows."""
    sums: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        s = sums.setdefault((r["region"], r["quarter"]), [0.0, 0.0])
        s[0] += r["revenue"]
        s[1] += r["cost"]
    margin = {k: 100 * (rev - cost) / rev for k, (rev, cost) in sums.items()}
    regions = sorted({k[0] for k in sums})
    per = {g: {"q1": margin[(g, "Q1")], "q2": margin[(g, "Q2")], "change": margin[(g, "Q2")] - margin[(g, "Q1")]} for g in regions}
    totals = {q: {"revenue": sum(v[0] for k, v in sums.items() if k[1] == q), "cost": sum(v[1] for k, v in sums.items() if k[1] == q)}
              for q in ("Q1", "Q2")}
    return per, totals


def _to_csv(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: r[c] for c in cols})
    return buf.getvalue()


def _numbers(text: str) -> list[float]:
    """Every number written in ``text`` (quarter names like Q1 and thousands separators aside)."""
    text = re.sub(r"\bQ[1-4]\b", " ", text)
    return [float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)]


class DataReportFamily(FamilyBase):
    """``agents.data_report``: margins by region from generated sales data, four checked deliverables."""

    name = "agents.data_report"
    domain = "agents"
    description = "data-analysis deliverables (answer, pivot report, chart spec, narrative) from CSV/JSON with pandas; rule gate, GRM for the narrative"
    verifiable = True
    kind = "workflow"  # opt-in: not in `default_families`
    max_difficulty = 3
    id_prefix = "report"

    def lexicon(self) -> tuple[str, ...]:
        return (*_REGIONS, *_PRODUCTS, "margin", "revenue", "cost", "quarter", "region")

    def grm_candidate(self, task: Task, final: FinalState) -> tuple[Verdict, tuple[str, dict[str, str]] | None]:
        """The narrative a GRM judges behind the rule gate (`report_candidate`)."""
        return report_candidate(task, final)

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        regions = sorted(rng.sample(_REGIONS, 4 + (difficulty > 1)))
        products = _PRODUCTS[: 1 if difficulty == 1 else rng.choice((2, 3))]
        rows = []
        for g in regions:
            for p in products:
                base, m1 = rng.randint(40, 160) * 1000, rng.uniform(0.15, 0.40)
                for q, m in (("Q1", m1), ("Q2", m1 + rng.uniform(-0.10, 0.04))):
                    rev = round(base * rng.uniform(0.8, 1.2), -2)
                    rows.append({"region": g, "quarter": q, "product": p, "revenue": rev, "cost": round(rev * (1 - m), -2)})
        per, totals = _margins(rows)
        order = sorted(regions, key=lambda g: per[g]["change"])
        worst = order[0]
        rev_drop = {g: sum(r["revenue"] * (1 if r["quarter"] == "Q2" else -1) for r in rows if r["region"] == g) for g in regions}
        if (per[order[1]]["change"] - per[worst]["change"] < 0.5 or per[worst]["change"] > -0.5
                or min(regions, key=lambda g: per[g]["q2"]) == worst or min(regions, key=rev_drop.__getitem__) == worst):
            return None  # a near tie, no fall, or the wrong metrics (lowest Q2 margin, revenue drop) give the same region
        if difficulty == 1:
            files = {"data/sales.csv": _to_csv(rows, ["region", "quarter", "revenue", "cost"])}
        elif difficulty == 2:
            files = {"data/sales.csv": _to_csv(rows, ["region", "quarter", "product", "revenue", "cost"])}
        else:
            files = {"data/revenue.csv": _to_csv(rows, ["region", "quarter", "product", "revenue"]),
                     "data/costs.json": json.dumps([{k: r[k] for k in ("region", "quarter", "product", "cost")} for r in rows], indent=1)}
        goal = ("Analyse the sales data in data/. margin_pct = 100 * (revenue - cost) / revenue, summed per region and quarter; "
                "change_pp = Q2 margin - Q1 margin. Which region's margin fell most from Q1 to Q2? Write:\n"
                "- out/answer.json: {\"region\": ..., \"change_pp\": ...}\n"
                f"- out/report.csv: columns {','.join(REPORT_COLUMNS)}, one row per region, sorted by change_pp ascending, 2 decimals\n"
                "- out/chart.json: a bar chart spec {\"type\": \"bar\", \"x\": \"region\", \"y\": \"change_pp\", \"data\": [{\"region\": ..., \"change_pp\": ...}, ...]} in the report's order\n"
                f"- out/summary.md: a short narrative ({SUMMARY_WORDS[0]}-{SUMMARY_WORDS[1]} words) for a manager: the region, its change, and context. "
                "Use only numbers from the data.\nrun_python runs Python with pandas in the working directory. Reply without a tool call when done.")
        meta = {"files": files, "difficulty": difficulty, "worst": worst, "margins": per, "totals": totals, "order": order}
        msgs = [{"role": "system", "content": "You are a data analyst with a Python sandbox."}, {"role": "user", "content": goal}]
        return self._task(task_id, msgs, meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        """list / read / write files and run_python over a sandbox seeded with the data; a plain reply ends it."""
        self._check_task(task)
        return ToolEnvironment([TOOLS[n] for n in ("list_files", "read_file", "write_file", "run_python")],
                               initial_state=lambda t: AETState(t.metadata["files"]), end_on_text=True,
                               limits=EpisodeLimits(max_turns=16), dump_state=lambda s: s.to_json(), load_state=AETState.from_json)

    def script(self, task: Task, *, mutate: str = "", sort: str = "change_pp", pick: str = "region", y: str = "change_pp",
               columns: Sequence[str] = REPORT_COLUMNS) -> str:
        """The pandas script the reference runs (the keyword arguments make the wrong variants)."""
        return _SCRIPT.format(load=_LOAD[task.metadata["difficulty"]], mutate=mutate, sort=sort, pick=pick, y=y, columns=list(columns))

    def summary(self, task: Task, extra: str = "") -> str:
        m = task.metadata
        w, per, order = m["worst"], m["margins"], m["order"]
        best = order[-1]
        return (f"{w} had the largest margin fall from Q1 to Q2: its margin went from {per[w]['q1']:.1f}% to {per[w]['q2']:.1f}%, "
                f"a change of {per[w]['change']:.1f} points. {best} held up best ({per[best]['change']:+.1f} points). "
                f"Across all regions, Q2 revenue was {m['totals']['Q2']['revenue']:,.0f} against a Q2 cost of "
                f"{m['totals']['Q2']['cost']:,.0f}. The pricing and cost mix in {w} should be reviewed first.{extra}")

    def _turns(self, task: Task, effort: str, code: str, summary: str | None) -> list[dict[str, Any]]:
        m = task.metadata
        data = sorted(m["files"])
        w, per = m["worst"], m["margins"]
        turns = []
        if effort == "max":
            turns.append(assistant("", "Look at the data first.", [tool_call("c0", "list_files", {})]))
            turns.append(assistant("", f"Files: {', '.join(data)}. Check the columns.", [tool_call("c1", "read_file", {"path": data[0]})]))
        think = {"max": "Aggregate per region and quarter, compute margins, write report, answer and chart in one script.",
                 "high": "pandas: margins per region and quarter, then the deliverables.", "low": ""}[effort]
        turns.append(assistant("", think, [tool_call("c2", "run_python", {"code": code})]))
        if summary is not None:
            think = {"max": f"The table shows {w} first: {per[w]['q1']:.2f} -> {per[w]['q2']:.2f}, change {per[w]['change']:.2f}. Write the summary.",
                     "high": f"{w} fell most ({per[w]['change']:.2f}).", "low": ""}[effort]
            turns.append(assistant("", think, [tool_call("c3", "write_file", {"path": "out/summary.md", "content": summary})]))
        turns.append(assistant(f"Done: {w}'s margin fell most. Deliverables are in out/.", ""))
        return turns

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """(max: list and read the data) → one pandas script → the summary quoting its output → a closing note."""
        return self._turns(task, effort, self.script(task), self.summary(task))

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        m = task.metadata
        w, per = m["worst"], m["margins"]
        fake = [{"region": g, "q1_margin_pct": round(per[g]["q1"] + 1.3, 2), "q2_margin_pct": round(per[g]["q2"], 2),
                 "change_pp": round(per[g]["change"] - 1.3, 2)} for g in m["order"]]
        fabricated = [assistant("", "", [tool_call(f"f{k}", "write_file", {"path": p, "content": c})]) for k, (p, c) in enumerate({
            "out/report.csv": _to_csv(fake, REPORT_COLUMNS),
            "out/answer.json": json.dumps({"region": w, "change_pp": fake[0]["change_pp"]}),
            "out/chart.json": json.dumps({"type": "bar", "x": "region", "y": "change_pp", "data": [{"region": r["region"], "change_pp": r["change_pp"]} for r in fake]}),
            "out/summary.md": self.summary(task).replace(f"{per[w]['change']:.1f}", f"{per[w]['change'] - 1.3:.1f}"),
        }.items())] + [assistant("Done.")]
        return {
            "empty": [assistant("")],
            "claims_success": [assistant(_CLAIM)],
            "copied_prompt": [assistant(prompt_text(task))],
            "fabricated_numbers": fabricated,
            "lowest_q2_margin": self._turns(task, "low", self.script(task, sort="q2_margin_pct"), self.summary(task)),
            "missing_column": self._turns(task, "low", self.script(task, columns=REPORT_COLUMNS[:3]), self.summary(task)),
            "chart_wrong_field": self._turns(task, "low", self.script(task, y="q2_margin_pct"), self.summary(task)),
            "no_summary": self._turns(task, "low", self.script(task), None),
            "copied_question_summary": self._turns(task, "low", self.script(task), task.messages[1]["content"][:400]),
            "invented_figure": self._turns(task, "low", self.script(task), self.summary(task, " Customer churn rose 87.3% in the quarter.")),
        }


def _report_ok(text: str | None, per: Mapping[str, Mapping[str, float]], order: Sequence[str]) -> bool:
    if text is None:
        return False
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or rows[0] != REPORT_COLUMNS or [r[0] for r in rows[1:] if r] != list(order):
        return False
    try:
        return all(abs(float(r[1]) - per[r[0]]["q1"]) <= TOL and abs(float(r[2]) - per[r[0]]["q2"]) <= TOL
                   and abs(float(r[3]) - per[r[0]]["change"]) <= TOL for r in rows[1:] if r)
    except (ValueError, IndexError):
        return False


def _json(text: str | None) -> Any:
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return None


def _close(x: Any, want: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x - want) <= TOL


@register_verifier("agents.data_report")
def verify_data_report(task: Task, final: FinalState) -> Verdict:
    """1.0 iff answer, report, chart and summary rules all hold on the final files (module docstring)."""
    m = task.metadata
    files, _, _ = final_state(final.state)
    per, order, w = m["margins"], m["order"], m["worst"]
    ans = _json(files.get("out/answer.json"))
    answer_ok = isinstance(ans, dict) and ans.get("region") == w and _close(ans.get("change_pp"), per[w]["change"])
    chart = _json(files.get("out/chart.json"))
    chart_ok = (isinstance(chart, dict) and chart.get("type") == "bar" and chart.get("x") == "region" and chart.get("y") == "change_pp"
                and isinstance(chart.get("data"), list) and [d.get("region") if isinstance(d, dict) else None for d in chart["data"]] == order
                and all(_close(d.get("change_pp"), per[d["region"]]["change"]) for d in chart["data"]))
    summary = files.get("out/summary.md") or ""
    allowed = [v for g in per.values() for v in g.values()] + [abs(g["change"]) for g in per.values()] + \
              [v for q in m["totals"].values() for v in q.values()]
    nums = _numbers(summary)
    words = len(summary.split())
    summary_ok = (SUMMARY_WORDS[0] <= words <= SUMMARY_WORDS[1] and w in summary
                  and any(abs(abs(x) - abs(per[w]["change"])) <= TOL for x in nums)
                  and all(any(abs(x - a) <= TOL for a in allowed) for x in nums))
    untouched = all(files.get(p) == t for p, t in m["files"].items())
    comps = {"answer": float(answer_ok), "report": float(_report_ok(files.get("out/report.csv"), per, order)),
             "chart": float(chart_ok), "summary_rules": float(summary_ok), "data_untouched": float(untouched)}
    ok = all(v == 1.0 for v in comps.values())
    bad = [k for k, v in comps.items() if v < 1.0]
    return Verdict(float(ok), comps, "" if ok else f"failed: {bad}; summary numbers {nums[:8]}")


def report_candidate(task: Task, final: FinalState) -> tuple[Verdict, tuple[str, dict[str, str]] | None]:
    """``agents.data_report``'s GRM hook (`DataReportFamily.grm_candidate`): (rule verdict, (the narrative
    ``out/summary.md``, its artifacts: ``out/report.csv``)), the candidate None when the rule gate fails (nothing to
    judge). `k3post.rewards.grm.gated.judged_reward` turns it into gate · quality."""
    verdict = verify_data_report(task, final)
    if verdict.reward <= 0.0:
        return verdict, None
    files, _, _ = final_state(final.state)
    return verdict, (files["out/summary.md"], {"out/report.csv": files["out/report.csv"]})


# =========================================================================== contracts

_PARTIES = ["Brightmoor Labs", "Kelvor Works", "Ostlin Foods", "Navra Systems", "Pelwen Motors", "Tamsev Textiles"]
_KINDS = ["Supply Agreement", "Services Agreement", "License Agreement"]
_LAWS = ["Norway", "Portugal", "Canada", "Japan", "Chile", "Austria"]
_CLAUSES: dict[str, tuple[str, str]] = {
    # key: (heading, body with {v})
    "term": ("Term", "This Agreement starts on the Effective Date and runs for {v} months unless terminated earlier."),
    "payment": ("Payment", "The Customer shall pay each undisputed invoice within {v} days of receipt."),
    "convenience": ("Termination for convenience", "Either party may terminate this Agreement for convenience by giving {v} days' written notice to the other party."),
    "breach": ("Termination for breach", "Either party may terminate this Agreement with immediate effect if the other party materially breaches it and fails to cure the breach within {v} days of notice."),
    "liability": ("Limitation of liability", "Each party's total liability under this Agreement is capped at {v} EUR, except for fraud."),
    "confidentiality": ("Confidentiality", "Each party shall keep the other party's confidential information secret for {v} years after this Agreement ends."),
    "law": ("Governing law", "This Agreement is governed by the laws of {v}."),
}
_VALUES = {
    "term": lambda r: str(r.choice([12, 18, 24, 36, 48])),
    "payment": lambda r: str(r.choice([15, 30, 45, 60, 90])),
    "convenience": lambda r: str(r.choice([30, 60, 90, 120])),
    "breach": lambda r: str(r.choice([10, 14, 21, 28])),
    "liability": lambda r: f"{r.randint(2, 40) * 25000:,}",
    "confidentiality": lambda r: str(r.choice([2, 3, 5, 7])),
    "law": lambda r: r.choice(_LAWS),
}
_UNIT = {"term": " months", "payment": " days", "convenience": " days", "breach": " days", "liability": " EUR",
         "confidentiality": " years", "law": ""}
_ASK = {
    "term": "How long does the {p} agreement run",
    "payment": "Within how many days must invoices under the {p} agreement be paid",
    "convenience": "How much notice is needed to terminate the {p} agreement for convenience",
    "liability": "What is the liability cap in the {p} agreement",
    "confidentiality": "For how long after the {p} agreement ends must confidential information be kept secret",
    "law": "Which country's law governs the {p} agreement",
}


def _contract(rng: random.Random, party: str) -> tuple[str, dict[str, str], dict[str, tuple[int, int]]]:
    """(text, clause values, clause key → gold body's character span) of one generated contract."""
    kind = rng.choice(_KINDS)
    text = f"{kind.upper()}\n\nThis {kind} is made between Alex Kim Trading Ltd (the Customer) and {party} (the Supplier).\n\n"
    values, spans = {}, {}
    keys = list(_CLAUSES)
    rng.shuffle(keys)
    for k, key in enumerate(keys, start=1):
        head, body = _CLAUSES[key]
        values[key] = _VALUES[key](rng)
        text += f"{k}. {head}. "
        start = len(text)
        text += body.format(v=values[key])
        spans[key] = (start, len(text))
        text += "\n\n"
    return text.rstrip() + "\n", values, spans


def span_iou(a: tuple[int, int], b: tuple[int, int]) -> float:
    """|a ∩ b| / |a ∪ b| of two half-open character spans (0 when both are empty)."""
    inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    union = (a[1] - a[0]) + (b[1] - b[0]) - inter
    return inter / union if union > 0 else 0.0


def _locate(doc: str, quote: str) -> tuple[int, int] | None:
    """The character span of ``quote`` in ``doc``, matching any run of whitespace to any run; None if absent."""
    words = quote.split()
    if not words:
        return None
    hit = re.search(r"\s+".join(map(re.escape, words)), doc)
    return (hit.start(), hit.end()) if hit else None


def _list_documents(ctx: ToolContext) -> str:
    assert ctx.task is not None
    return "\n".join(f"{d} | {v['title']}" for d, v in ctx.task.metadata["docs"].items())


def _read_document(ctx: ToolContext, doc_id: str) -> str:
    assert ctx.task is not None
    docs = ctx.task.metadata["docs"]
    if doc_id not in docs:
        raise ValueError(f"no document {doc_id!r}; list_documents shows the ids")
    ctx.state["read"].append(doc_id)
    return docs[doc_id]["text"]


_QUOTE = {"type": "object", "properties": {"doc_id": {"type": "string"}, "text": {"type": "string"}},
          "required": ["doc_id", "text"], "additionalProperties": False}
CONTRACT_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("list_documents", "List the contracts as 'id | title'.", {"type": "object", "properties": {}, "additionalProperties": False},
             True, _list_documents),
    ToolSpec("read_document", "Return a contract's full text.", {"type": "object", "properties": {"doc_id": {"type": "string"}},
             "required": ["doc_id"], "additionalProperties": False}, True, _read_document),
    ToolSpec("submit", "Submit the answer and the verbatim quotes of the clauses that support it; ends the episode.",
             {"type": "object", "properties": {"answer": {"type": "string"}, "quotes": {"type": "array", "items": _QUOTE}},
              "required": ["answer", "quotes"], "additionalProperties": False}, False, None),
)


class ContractsFamily(FamilyBase):
    """``agents.contracts``: answer from generated contracts and quote the clauses; span-overlap verifier."""

    name = "agents.contracts"
    domain = "agents"
    description = "legal/contract questions over 3-5 generated contracts: answer and quote the clauses (span IoU >= 0.6)"
    verifiable = True
    kind = "workflow"  # opt-in: not in `default_families`
    max_difficulty = 3
    id_prefix = "contract"

    def lexicon(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([w for p in _PARTIES for w in p.split()] + [*_LAWS, "Agreement", "clause"]))

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        parties = rng.sample(_PARTIES, 2 + difficulty)
        docs, values, spans = {}, {}, {}
        for k, p in enumerate(parties):
            did = f"c{k + 1}"
            text, values[did], spans[did] = _contract(rng, p)
            docs[did] = {"title": f"Agreement with {p}", "party": p, "text": text}
        if difficulty == 3:
            pay = {d: int(v["payment"]) for d, v in values.items()}
            longest = max(pay, key=pay.__getitem__)
            if sorted(pay.values())[-2] == pay[longest]:
                return None
            question = "Which counterparty's agreement gives the Customer the longest time to pay invoices? Quote the clause."
            gold = [(longest, "payment")]
            expect = [[docs[longest]["party"]]]
            avoid = [docs[d]["party"] for d in docs if d != longest]
        else:
            did = rng.choice(sorted(docs))
            keys = rng.sample(sorted(_ASK), difficulty)
            party = docs[did]["party"]
            question = " and ".join(_ASK[k].format(p=party) if i == 0 else _ASK[k].format(p=party)[0].lower() + _ASK[k].format(p=party)[1:]
                                    for i, k in enumerate(keys)) + "? Quote the clause(s) that say so."
            gold = [(did, k) for k in keys]
            expect = [[values[did][k]] for k in keys]
            avoid = [values[d][k] for k in keys for d in docs if d != did and values[d][k] != values[did][k]]
            if any(normalize_answer(a) in normalize_answer(e[0]) or normalize_answer(e[0]) in normalize_answer(a) for a in avoid for e in expect):
                return None  # "5" inside "25": a substring clash would make the value check ambiguous
        meta = {"docs": docs, "values": values, "spans": {d: {k: list(s) for k, s in v.items()} for d, v in spans.items()},
                "gold": [list(g) for g in gold], "expect": expect, "avoid": avoid, "compare": difficulty == 3}
        msgs = [{"role": "system", "content": "You are a contracts analyst. Read the documents with your tools; answer briefly and "
                 "submit verbatim quotes of the clauses that support the answer."}, {"role": "user", "content": question}]
        return self._task(task_id, msgs, meta)

    def make_env(self, task: Task) -> ToolEnvironment:
        self._check_task(task)
        return ToolEnvironment(CONTRACT_TOOLS, initial_state=lambda t: {"read": []}, submit_tool="submit", end_on_text=True,
                               limits=EpisodeLimits(max_turns=16))

    def _gold_text(self, task: Task, did: str, key: str) -> str:
        s, e = task.metadata["spans"][did][key]
        return task.metadata["docs"][did]["text"][s:e]

    def _answer(self, task: Task, gold: Sequence[Sequence[str]]) -> str:
        m = task.metadata
        if m["compare"]:
            d = gold[0][0]
            return f"{m['docs'][d]['party']}: invoices are payable within {m['values'][d]['payment']} days."
        return "; ".join(f"{_CLAUSES[k][0]}: {m['values'][d][k]}{_UNIT[k]}" for d, k in gold) + "."

    def _submit(self, answer: str, quotes: Sequence[tuple[str, str]], think: str = "") -> dict[str, Any]:
        return assistant("", think, [tool_call("submit", "submit", {"answer": answer, "quotes": [{"doc_id": d, "text": t} for d, t in quotes]})])

    def _reads(self, task: Task, effort: str) -> list[dict[str, Any]]:
        m = task.metadata
        want = sorted(m["docs"]) if m["compare"] else sorted({d for d, _ in m["gold"]})
        turns = [assistant("", {"max": "List the contracts to find the right one.", "high": "List documents.", "low": ""}[effort],
                           [tool_call("l", "list_documents", {})])]
        for d in want:
            think = {"max": f"{d} is the {m['docs'][d]['title']}. Read it.", "high": f"Read {d}.", "low": ""}[effort]
            turns.append(assistant("", think, [tool_call(f"r{d}", "read_document", {"doc_id": d})]))
        return turns

    def reference_turns(self, task: Task, effort: str) -> list[dict[str, Any]]:
        """list → read the contract(s) the question needs (all for a comparison) → submit answer and clause quotes."""
        m = task.metadata
        gold = [tuple(g) for g in m["gold"]]
        quotes = [(d, self._gold_text(task, d, k)) for d, k in gold]
        think = {"max": " ".join(f"{d} clause '{_CLAUSES[k][0]}': {t}" for (d, k), (_, t) in zip(gold, quotes)),
                 "high": "Found the clause(s).", "low": ""}[effort]
        return self._reads(task, effort) + [self._submit(self._answer(task, gold), quotes, think)]

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        m = task.metadata
        gold = [tuple(g) for g in m["gold"]]
        reads = self._reads(task, "low")
        answer = self._answer(task, gold)
        quotes = [(d, self._gold_text(task, d, k)) for d, k in gold]
        d0, k0 = gold[0]
        other = next(d for d in sorted(m["docs"]) if d != d0)
        neighbour = "breach" if k0 != "breach" else "convenience"
        wrong_doc = [(other, k) for _, k in gold]
        out = {
            "empty": [assistant("")],
            "claims_success": [assistant("I found and quoted the relevant clauses. The task is complete.")],
            "copied_prompt": [self._submit(prompt_text(task), [])],
            "answer_without_quotes": reads + [self._submit(answer, [])],
            "wrong_contract": reads + [self._submit(self._answer(task, wrong_doc), [(d, self._gold_text(task, d, k)) for d, k in wrong_doc])],
            "neighbour_clause": reads + [self._submit(answer, [(d0, self._gold_text(task, d0, neighbour))] + quotes[1:])],
            "whole_document": reads + [self._submit(answer, [(d0, m["docs"][d0]["text"])])],
            "paraphrased_quote": reads + [self._submit(answer, [(d, "The contract says: " + t.lower().replace("this agreement", "the contract")) for d, t in quotes])],
            "partial_quote": reads + [self._submit(answer, [(d, " ".join(t.split()[: max(2, len(t.split()) // 3)])) for d, t in quotes])],
            "extra_quotes": reads + [self._submit(answer, quotes + [(other, self._gold_text(task, other, k0))])],
        }
        if m["avoid"]:  # hedging needs another contract's (different) value to name
            out["all_values"] = reads + [self._submit(answer + " Or: " + ", ".join(m["avoid"]), quotes)]
        return out


@register_verifier("agents.contracts")
def verify_contracts(task: Task, final: FinalState) -> Verdict:
    """1.0 iff the answer has every expected value and no other contract's, and the quotes pair with the gold
    clauses at IoU >= `SPAN_IOU` (each quote verbatim in its document, no stray quote, every clause covered)."""
    m = task.metadata
    sub = final.submission if isinstance(final.submission, dict) else {}
    answer = normalize_answer(sub.get("answer") if isinstance(sub.get("answer"), str) else "")
    answer_ok = bool(answer) and all(any(normalize_answer(v) in answer for v in group) for group in m["expect"]) and \
        not any(normalize_answer(a) in answer for a in m["avoid"])
    quotes = sub.get("quotes") if isinstance(sub.get("quotes"), list) else []
    located, fabricated = [], 0
    for q in quotes:
        doc = m["docs"].get(q.get("doc_id")) if isinstance(q, dict) else None
        span = _locate(doc["text"], q.get("text", "")) if doc and isinstance(q.get("text"), str) else None
        if span is None:
            fabricated += 1
        else:
            located.append((q["doc_id"], span))
    gold = [(d, tuple(m["spans"][d][k])) for d, k in m["gold"]]

    def match(q: tuple[str, tuple[int, int]], g: tuple[str, tuple[int, int]]) -> bool:
        return q[0] == g[0] and span_iou(q[1], g[1]) >= SPAN_IOU

    covered = all(any(match(q, g) for q in located) for g in gold)
    stray = sum(1 for q in located if not any(match(q, g) for g in gold))
    best = [max((span_iou(q[1], g[1]) for q in located if q[0] == g[0]), default=0.0) for g in gold]
    comps = {"answer": float(answer_ok), "quotes_verbatim": float(bool(quotes) and fabricated == 0),
             "clauses_covered": float(covered), "no_stray_quotes": float(stray == 0), "min_iou": min(best) if best else 0.0}
    ok = answer_ok and bool(quotes) and fabricated == 0 and covered and stray == 0
    return Verdict(float(ok), comps, "" if ok else f"answer ok {answer_ok}; {fabricated} quote(s) not in the document; "
                   f"best IoU per clause {[round(b, 2) for b in best]}; {stray} stray quote(s)")


DATA_REPORT = register_family(DataReportFamily())
CONTRACTS = register_family(ContractsFamily())
