"""A cost model of the rollout engine: what one engine ``step()`` costs as a function of its work.

The partial-rollout scheduler (`scheduler.py`) makes no wall-clock decision: which requests run in
which step depends only on completions, never on time. So the wall time of a rollout is

    T = Σ_steps c(step) + T_outside

where ``c`` prices one engine step from the work in it (`StepWork`: rows decoded, their total
context, prefill tokens) and ``T_outside`` is the agent loop / environments / scheduler between
steps (per finished turn, `CostCurve.outside_ms_per_turn`). Given the step trace of a run, any cost
curve predicts its time; that is how ``bench/partial_rollout.py`` validates the model against a
measured run and prices the same scheduling under another machine's curve (``--simulate``).

**The curve** (`CostCurve`, JSON, measured by ``bench/step_cost.py``):

* ``decode_ms[i][j]``: one decode step of ``batches[i]`` rows each at context ``contexts[j]``.
  A step with ``rows`` rows of mean context ``ctx`` costs the bilinear interpolation over
  (rows, ctx); beyond the grid the cost extends linearly (rows above the largest batch scale the
  largest batch's cost per row; contexts beyond the grid extend the last context slope, never
  below the last measured value).
* ``prefill_ms``: a step that only prefills ``prefill_tokens[k]`` tokens; in between linear,
  beyond the last point the last per-token slope.
* ``step_ms``: the fixed cost of a step, paid once when a step both decodes and prefills
  (decode + prefill - ``step_ms``). None: the decode line at 0 rows (smallest context), clamped
  to [0, the one-row cost].
* ``source``: where the numbers come from (machine, model, command). Every prediction made with
  a curve carries it.

Two ways to get a curve: ``bench/step_cost.py`` times the engine alone on a grid (a kernel-level
curve: no finishing requests, KV hand-offs or sampling stops, so it is a lower bound inside a real
rollout), and `fit_linear` fits the steps of a measured rollout to

    c = a + b·rows + c·context + d·[prefill > 0] + e·prefill_tokens        (ms)

and writes it as the same table (exactly, the form being bilinear in rows and context, unless a fitted slope is
negative: the table never prices a step below 1e-6 ms nor, past the last context, below the last column). On a CPU, where
every term is real work, the fit on one run predicts another (``bench/partial_rollout.py
--fit-curve``: fitted on the synchronous runs, it predicts the partial ones).

Shape legend: none (tables are nested lists: ``decode_ms[batch index][context index]``).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["StepWork", "CostCurve", "fit_linear", "predict_engine_s", "step_work_summary"]


@dataclass(frozen=True)
class StepWork:
    """The work of one engine step: ``rows`` decoded (one token each) over ``context`` positions in
    total (the sum of the decoded rows' contexts), and ``prefill`` tokens prefilled in it."""

    rows: int
    context: int
    prefill: int

    def __post_init__(self) -> None:
        for name in ("rows", "context", "prefill"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"StepWork.{name} must be an int >= 0, got {v!r}")
        if self.rows == 0 and self.context:
            raise ValueError(f"StepWork: context {self.context} with no rows decoded")


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing), extended linearly past both ends."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class CostCurve:
    """Measured cost of engine steps (module doc). ``source`` names the machine, model and command."""

    batches: list[int]
    contexts: list[int]
    decode_ms: list[list[float]]
    prefill_tokens: list[int]
    prefill_ms: list[float]
    source: str
    step_ms: float | None = None
    outside_ms_per_turn: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def increasing(name: str, xs: Sequence[int]) -> None:
            if not xs or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in xs) \
                    or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"CostCurve.{name} must be a non-empty increasing list of ints >= 1, got {xs!r}")

        increasing("batches", self.batches)
        increasing("contexts", self.contexts)
        increasing("prefill_tokens", self.prefill_tokens)
        if len(self.decode_ms) != len(self.batches) or any(len(r) != len(self.contexts) for r in self.decode_ms):
            raise ValueError(
                f"CostCurve.decode_ms must be {len(self.batches)} rows (batches) x {len(self.contexts)} columns "
                f"(contexts), got {[len(r) for r in self.decode_ms]}"
            )
        if len(self.prefill_ms) != len(self.prefill_tokens):
            raise ValueError(
                f"CostCurve.prefill_ms has {len(self.prefill_ms)} values for {len(self.prefill_tokens)} prefill_tokens"
            )
        for i, row in enumerate(self.decode_ms):
            for j, v in enumerate(row):
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise ValueError(f"CostCurve.decode_ms[{i}][{j}] must be a finite number > 0, got {v!r}")
        for k, v in enumerate(self.prefill_ms):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"CostCurve.prefill_ms[{k}] must be a finite number > 0, got {v!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("CostCurve.source must say where the numbers come from (machine, model, command)")
        if not isinstance(self.outside_ms_per_turn, (int, float)) or self.outside_ms_per_turn < 0:
            raise ValueError(f"CostCurve.outside_ms_per_turn must be >= 0, got {self.outside_ms_per_turn!r}")
        if self.step_ms is None:
            one = float(self.decode_ms[0][0]) / self.batches[0]
            fixed = _interp(self.batches, [r[0] for r in self.decode_ms], 0.0) if len(self.batches) > 1 else 0.0
            self.step_ms = min(max(fixed, 0.0), one)
        elif not isinstance(self.step_ms, (int, float)) or not math.isfinite(self.step_ms) or self.step_ms < 0:
            raise ValueError(f"CostCurve.step_ms must be a finite number >= 0, got {self.step_ms!r}")

    # ------------------------------------------------------------------ pricing

    def decode_step_ms(self, rows: int, mean_context: float) -> float:
        """One decode step of ``rows`` rows at mean context ``mean_context`` (module doc)."""
        if rows <= 0:
            return 0.0
        top = self.batches[-1]
        scale = 1.0
        if rows > top:
            scale, rows = rows / top, top
        per_ctx = [_interp(self.batches, [self.decode_ms[i][j] for i in range(len(self.batches))], float(rows))
                   for j in range(len(self.contexts))]
        ms = _interp(self.contexts, per_ctx, mean_context)
        if mean_context > self.contexts[-1]:
            ms = max(ms, per_ctx[-1])
        return max(ms, 1e-6) * scale

    def prefill_step_ms(self, tokens: int) -> float:
        """A step that only prefills ``tokens`` tokens."""
        if tokens <= 0:
            return 0.0
        return max(_interp(self.prefill_tokens, self.prefill_ms, float(tokens)), 1e-6)

    def price(self, work: StepWork) -> float:
        """Milliseconds of one engine step doing ``work``."""
        if work.rows == 0:
            return self.prefill_step_ms(work.prefill)
        ms = self.decode_step_ms(work.rows, work.context / work.rows)
        if work.prefill:
            ms += max(self.prefill_step_ms(work.prefill) - float(self.step_ms or 0.0), 0.0)
        return ms

    def with_fixed_cost(self, step_ms: float, note: str) -> "CostCurve":
        """This curve with the fixed cost of a step set to ``step_ms`` (every table entry moves by the
        difference; per-row, per-context and per-token costs unchanged): how the partial-rollout gain
        depends on the share of a step that does not grow with its work. ``note`` goes into the source."""
        delta = float(step_ms) - float(self.step_ms or 0.0)
        return CostCurve(
            batches=list(self.batches), contexts=list(self.contexts),
            decode_ms=[[max(v + delta, 1e-6) for v in row] for row in self.decode_ms],
            prefill_tokens=list(self.prefill_tokens), prefill_ms=[max(v + delta, 1e-6) for v in self.prefill_ms],
            source=f"{self.source}; {note}", step_ms=max(float(step_ms), 0.0),
            outside_ms_per_turn=self.outside_ms_per_turn, meta=dict(self.meta),
        )

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, d: Any, where: str = "cost curve") -> "CostCurve":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
        missing = sorted(k for k in ("batches", "contexts", "decode_ms", "prefill_tokens", "prefill_ms", "source")
                         if k not in d)
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return cls.from_dict(d, str(path))


def predict_engine_s(trace: Iterable[StepWork], curve: CostCurve) -> float:
    """Seconds the engine steps of ``trace`` take under ``curve``."""
    return sum(curve.price(w) for w in trace) / 1000.0


def step_work_summary(trace: Sequence[StepWork]) -> dict[str, float]:
    """Steps, decode tokens, prefill tokens and mean rows per decode step of a trace."""
    dec = [w for w in trace if w.rows]
    return {
        "steps": len(trace),
        "decode_tokens": sum(w.rows for w in trace),
        "prefill_tokens": sum(w.prefill for w in trace),
        "mean_rows": (sum(w.rows for w in dec) / len(dec)) if dec else 0.0,
        "mean_context": (sum(w.context for w in dec) / max(1, sum(w.rows for w in dec))) if dec else 0.0,
    }


def fit_linear(
    work: Sequence[StepWork], seconds: Sequence[float], source: str, *,
    batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), contexts: Sequence[int] = (128, 1024, 4096),
    prefill_tokens: Sequence[int] = (16, 256, 1024, 4096),
) -> CostCurve:
    """Least-squares fit of ``c = a + b·rows + c·context + d·[prefill > 0] + e·prefill`` (ms) to
    measured steps, written as a `CostCurve` table on the given grid (module doc). Coefficients
    (and the fit's R² and step count) are in ``meta["linear"]``. Raises when the steps cannot
    identify the five coefficients (no decode steps of two batch sizes, no prefill)."""
    if len(work) != len(seconds) or not work:
        raise ValueError(f"fit_linear: {len(work)} steps of work for {len(seconds)} times")
    X = np.array([[1.0, w.rows, w.context, float(w.prefill > 0), w.prefill] for w in work])
    y = 1000.0 * np.asarray(seconds, dtype=float)
    if np.linalg.matrix_rank(X) < X.shape[1]:
        raise ValueError("fit_linear: the steps do not vary enough to fit rows, context and prefill apart "
                         "(need decode steps of different sizes and steps with and without prefill)")
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    a, b, c, d, e = (float(x) for x in coef)
    r2 = 1.0 - float(((X @ coef - y) ** 2).sum()) / max(1e-12, float(((y - y.mean()) ** 2).sum()))
    floor = 1e-6
    decode = [[max(a + b * n + c * n * ctx, floor) for ctx in contexts] for n in batches]
    prefill = [max(a + d + e * p, floor) for p in prefill_tokens]
    return CostCurve(
        batches=list(batches), contexts=list(contexts), decode_ms=decode, prefill_tokens=list(prefill_tokens),
        prefill_ms=prefill, source=source, step_ms=max(a, 0.0),
        meta={"linear": {"a_ms": a, "b_ms_per_row": b, "c_ms_per_context": c, "d_ms_prefill_step": d,
                         "e_ms_per_prefill_token": e, "r2": r2, "steps": len(work)}},
    )
