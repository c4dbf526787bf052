"""general.visual: read a value off a chart or a STEM figure rendered locally with matplotlib (Agg).

Five kinds of figure, each with one numeric question and a stated tolerance:

* ``bar``      - the value of one labelled bar;
* ``line``     - a yearly series' value in one labelled year;
* ``scatter``  - the slope of the least-squares line through the plotted points (the trend);
* ``function`` - the x of the turning point of a plotted parabola;
* ``angle``    - one angle of a labelled triangle (equal axes, so pixel angles are true angles).

Each task declares its modality (``metadata["modality"]``, drawn per task):

* ``vision`` - the prompt carries the PNG as an ``image_url`` part (a data URL; XTML renders it as the
  K3 image placeholder); the ``python`` tool runs the policy's code in the sandbox next to ``chart.png``
  and ``imgtools.py`` (`k3post.envs.families.visual.image`), and every PNG the code saves under ``out/``
  comes back as an image part of the tool message; ``measure`` is offered too.
* ``text``   - no image in the prompt: the ``measure`` tool returns numbers (colours, blobs, a column's
  pixels, extreme points, the text labels with their pixel positions as OCR would read them).

The verifier reads the submitted answer: exactly one finite number (an angle may carry ``°``), within
the tolerance of the value computed from the generating data, which never leaves this process: the
sandbox gets only the PNG (no metadata chunks) and the toolkit, and sees no host file or process.
The reference solver measures the image (never the hidden data) and converts pixels to values with
the tick labels.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import re
from pathlib import Path
from typing import Any

from k3post.envs.env import EpisodeLimits, StepResult, ToolEnvironment
from k3post.envs.families.common import FamilyBase, assistant, check_effort, prompt_text, scripted_policy, submission_text, tool_call
from k3post.envs.families.registry import register_family
from k3post.envs.sandbox import Sandbox, SandboxLimits
from k3post.envs.task import FinalState, Task, Verdict, register_verifier
from k3post.envs.tools import ToolContext, ToolSpec

__all__ = ["VisualFamily", "parse_number", "render"]

NAME = "general.visual"
KINDS = ("bar", "line", "scatter", "function", "angle")
W, H = 480, 360
DATA_COLORS = ("#1f5fbf", "#d62728", "#2ca02c", "#9467bd", "#e377c2")
RUN_LIMITS = SandboxLimits(cpu_s=10.0, wall_s=20.0, memory_bytes=1024**3, max_output_bytes=64 * 1024)
MAX_IMAGES = 4  # returned per python call
MAX_IMAGE_BYTES = 256 * 1024
TOLERANCE_SCALE = {1: 1.0, 2: 0.8, 3: 0.6}  # harder: tighter tolerance (and more bars / points, noisier scatter)
TOOLKIT = Path(__file__).with_name("image.py")
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:°|deg|degrees?)?\s*$")

# ------------------------------------------------------------------ rendering


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(W / 100, H / 100), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.12, right=0.96, bottom=0.12, top=0.9)
    return fig, fig.add_subplot()


def _ticks(ax: Any, axis: str, ticks: list[float]) -> None:
    labels = [f"{t:g}" for t in ticks]
    (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, labels=labels)


def render(spec: dict[str, Any]) -> tuple[bytes, list[dict[str, Any]]]:
    """The figure of ``spec`` as PNG bytes (RGB, no metadata chunks) and its text layer
    ``[{"text", "x", "y"}]`` (label centres in pixels, origin top-left)."""
    from PIL import Image

    fig, ax = _figure()
    kind, color = spec["kind"], spec["color"]
    if kind == "bar":
        ax.bar(range(len(spec["labels"])), spec["values"], width=0.6, color=color, antialiased=False)
        ax.set_xticks(range(len(spec["labels"])), labels=spec["labels"])
        ax.set_ylim(0, 100)
        _ticks(ax, "y", [0, 20, 40, 60, 80, 100])
    elif kind == "line":
        ax.plot(spec["xs"], spec["values"], color=color, lw=1.5, antialiased=False)
        ax.set_xlim(spec["xs"][0] - 0.5, spec["xs"][-1] + 0.5)
        _ticks(ax, "x", spec["xs"][::2])
        ax.set_ylim(0, 100)
        _ticks(ax, "y", [0, 20, 40, 60, 80, 100])
    elif kind == "scatter":
        ax.plot(spec["xs"], spec["ys"], "o", ms=6, color=color, antialiased=False)
        ax.set_xlim(0, 10)
        _ticks(ax, "x", [0, 2, 4, 6, 8, 10])
        ax.set_ylim(spec["ylim"])
        _ticks(ax, "y", spec["yticks"])
    elif kind == "function":
        xs = [-5 + i * 0.02 for i in range(501)]
        a, h, k = spec["a"], spec["h"], spec["k"]
        ax.plot(xs, [a * (x - h) ** 2 + k for x in xs], color=color, lw=1.5, antialiased=False)
        ax.set_xlim(-5, 5)
        _ticks(ax, "x", [-4, -2, 0, 2, 4])
        ax.set_ylim(spec["ylim"])
        _ticks(ax, "y", spec["yticks"])
        ax.axhline(0, color="#999999", lw=0.8)
        ax.set_title("y = f(x)")
    else:  # angle
        pts = spec["points"]
        ax.plot([p[0] for p in pts + pts[:1]], [p[1] for p in pts + pts[:1]], color="black", lw=1.2)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ms=7, color=color, antialiased=False, zorder=3)
        gx, gy = sum(p[0] for p in pts) / 3, sum(p[1] for p in pts) / 3
        for name, (px, py) in zip("ABC", pts):
            d = math.hypot(px - gx, py - gy) or 1.0
            ax.text(px + 0.7 * (px - gx) / d, py + 0.7 * (py - gy) / d, name, ha="center", va="center", fontsize=12)
        ax.set_xlim(-1.5, 11.5)
        ax.set_ylim(-1.5, 11.5)
        ax.set_aspect("equal")
        ax.axis("off")
    canvas = fig.canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    artists = list(ax.texts) + [ax.title]
    if kind != "angle":
        artists += list(ax.get_xticklabels()) + list(ax.get_yticklabels())
    layer = []
    for t in artists:
        if t.get_visible() and t.get_text():
            bb = t.get_window_extent(renderer)
            layer.append({"text": t.get_text(), "x": round((bb.x0 + bb.x1) / 2, 1), "y": round(H - (bb.y0 + bb.y1) / 2, 1)})
    rgba = Image.frombuffer("RGBA", canvas.get_width_height(), bytes(canvas.buffer_rgba()))
    buf = io.BytesIO()
    rgba.convert("RGB").save(buf, format="PNG", optimize=True)
    return buf.getvalue(), layer


# ------------------------------------------------------------------ task drawing

CATEGORIES = ("North", "South", "East", "West", "Alpha", "Beta", "Gamma", "Delta", "Q1", "Q2", "Q3", "Q4")


def _nice_ticks(lo: float, hi: float) -> tuple[list[float], list[float]]:
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50) if (hi - lo) / s <= 6)
    a, b = math.floor(lo / step) * step, math.ceil(hi / step) * step
    return [a, b], [a + i * step for i in range(round((b - a) / step) + 1)]


def _draw(rng: random.Random, kind: str, difficulty: int) -> tuple[dict[str, Any], str, float, float] | None:
    """``(spec, question, answer, tolerance at difficulty 1)``."""
    color = rng.choice(DATA_COLORS)
    if kind == "bar":
        n = 3 + difficulty
        labels = rng.sample(CATEGORIES[8:] if n <= 4 and rng.random() < 0.5 else CATEGORIES[:8], n)
        values = [rng.randint(8, 95) for _ in labels]
        i = rng.randrange(len(labels))
        return {"kind": kind, "color": color, "labels": labels, "values": values}, (
            f"What value does the bar labelled '{labels[i]}' show?"
        ), float(values[i]), 2.5
    if kind == "line":
        start = rng.randint(1990, 2012)
        xs = list(range(start, start + 11))
        v, values = rng.uniform(20, 80), []
        for _ in xs:
            v = min(92.0, max(8.0, v + rng.uniform(-12, 12)))
            values.append(round(v, 1))
        year = rng.choice(xs[::2][1:-1])
        return {"kind": kind, "color": color, "xs": xs, "values": values}, (
            f"What is the value of the series in {year}?"
        ), values[xs.index(year)], 3.0
    if kind == "scatter":
        m = rng.choice((-1, 1)) * rng.uniform(0.8, 4.0)
        c = rng.uniform(-10, 10)
        n = 8 + 2 * difficulty
        xs = [round(1 + 8 * i / (n - 1) + rng.uniform(-0.15, 0.15), 2) for i in range(n)]
        ys = [round(m * x + c + rng.gauss(0, 0.6 * difficulty), 2) for x in xs]
        xbar, ybar = sum(xs) / n, sum(ys) / n
        slope = sum((x - xbar) * (y - ybar) for x, y in zip(xs, ys)) / sum((x - xbar) ** 2 for x in xs)
        ylim, yticks = _nice_ticks(min(ys) - 1, max(ys) + 1)
        return {"kind": kind, "color": color, "xs": xs, "ys": ys, "ylim": ylim, "yticks": yticks}, (
            "What is the slope of the least-squares line through the plotted points?"
        ), round(slope, 3), round(max(0.1 * abs(slope), 0.15), 3)
    if kind == "function":
        a = rng.choice((-1, 1)) * rng.uniform(0.4, 1.2)
        h, k = round(rng.uniform(-3, 3), 1), round(rng.uniform(-4, 4), 1)
        far = a * 2.5**2 + k  # the curve's value 2.5 units away from the turning point
        ylim, yticks = _nice_ticks(min(k, far) - 1, max(k, far) + 1)
        turn = "minimum" if a > 0 else "maximum"
        return {"kind": kind, "color": color, "a": round(a, 3), "h": h, "k": k, "ylim": ylim, "yticks": yticks}, (
            f"The plotted curve is a parabola. At what x does it reach its {turn}?"
        ), h, 0.25
    pts = [[round(rng.uniform(0, 10), 2), round(rng.uniform(0, 10), 2)] for _ in range(3)]
    angles = _triangle_angles(pts)
    sides = [math.dist(pts[i], pts[(i + 1) % 3]) for i in range(3)]
    if min(angles) < 20 or min(sides) < 3.5:
        return None
    i = rng.randrange(3)
    q = "ABC"[(i - 1) % 3] + "ABC"[i] + "ABC"[(i + 1) % 3]
    return {"kind": kind, "color": color, "points": pts}, f"What is the angle {q} (at vertex {'ABC'[i]}) in degrees?", round(angles[i], 2), 2.0


def _triangle_angles(pts: list[list[float]]) -> list[float]:
    """Interior angles in degrees at each of the three points."""
    out = []
    for i in range(3):
        p, a, b = pts[i], pts[(i - 1) % 3], pts[(i + 1) % 3]
        u, v = (a[0] - p[0], a[1] - p[1]), (b[0] - p[0], b[1] - p[1])
        cos = (u[0] * v[0] + u[1] * v[1]) / (math.hypot(*u) * math.hypot(*v))
        out.append(math.degrees(math.acos(max(-1.0, min(1.0, cos)))))
    return out


# ------------------------------------------------------------------ verifier


def parse_number(text: str) -> float | None:
    """The one finite number ``text`` states (``"41.5"``, ``"62°"``), else None (ranges, lists, words, inf)."""
    m = _NUMBER.match(text) if isinstance(text, str) else None
    if m is None:
        return None
    v = float(m.group(1))
    return v if math.isfinite(v) else None


@register_verifier(NAME)
def verify_visual(task: Task, final: FinalState) -> Verdict:
    """1 when the submitted number is within the stated tolerance of the true value, else 0."""
    want, tol = float(task.metadata["answer"]), float(task.metadata["tolerance"])
    if final.truncated:
        return Verdict(0.0, {"format": 0.0, "correct": 0.0}, f"truncated ({final.truncation})")
    got = parse_number(submission_text(final.submission))
    if got is None:
        return Verdict(0.0, {"format": 0.0, "correct": 0.0}, "the answer is not exactly one number")
    ok = abs(got - want) <= tol
    return Verdict(float(ok), {"format": 1.0, "correct": float(ok)}, f"answered {got:g}, true {want:g} ± {tol:g}")


# ------------------------------------------------------------------ environment


def _png(task: Task) -> bytes:
    return base64.b64decode(task.metadata["png"])


def _measure(ctx: ToolContext, op: str, color: str = "", x: int = 0, tol: int = 40) -> Any:
    from PIL import Image

    from k3post.envs.families.visual import image as visual_image

    task = ctx.task
    assert task is not None
    if op == "text":
        return task.metadata["text_layer"]
    return visual_image.measure(Image.open(io.BytesIO(_png(task))), op, color=color, x=x, tol=tol)


def _python(ctx: ToolContext, code: str) -> str:
    """Run ``code`` in a fresh sandbox holding chart.png, imgtools.py and the images saved so far under out/."""
    env, task, state = ctx.env, ctx.task, ctx.state
    assert task is not None
    with Sandbox(limits=RUN_LIMITS) as sb:
        sb.write_file("chart.png", _png(task))
        sb.write_file("imgtools.py", TOOLKIT.read_text())
        sb.write_file("main.py", code)
        sb.write_file("out/README", "PNG files saved here come back as images.\n")
        for name, b64 in state["images"].items():
            sb.write_file(f"out/{name}", base64.b64decode(b64))
        before = dict(state["images"])
        res = sb.run(["python3", "main.py"])
        new: list[str] = []
        for path in sb.list_files():
            p = Path(path)
            if p.parent.name != "out" or p.suffix != ".png" or len(state["images"]) >= 16:
                continue
            data = (sb.workdir / path).read_bytes()
            b64 = base64.b64encode(data).decode("ascii")
            if len(data) <= MAX_IMAGE_BYTES and before.get(p.name) != b64:
                state["images"][p.name] = b64
                new.append(p.name)
    new = sorted(new)[:MAX_IMAGES]
    if isinstance(env, VisualEnv):
        env.pending[ctx.call_id] = [state["images"][n] for n in new]
    text = f"exit code {res.returncode}" + (f" ({res.killed_reason})" if res.killed_reason else "")
    text += f"\nstdout:\n{res.stdout}" + (f"\nstderr:\n{res.stderr[-2000:]}" if res.stderr else "")
    return text + (f"\nimages: {', '.join('out/' + n for n in new)}" if new else "")


MEASURE = ToolSpec(
    "measure",
    "Measure the chart image (pixels, origin top-left). op: 'size'; 'colors' (most frequent non-grey colours); "
    "'text' (the text labels with their centre pixels, as OCR reads them); 'blobs' (connected regions of `color`: "
    "box, centroid, pixel count); 'column' (rows where column `x` has `color`); 'extremes' (top/bottom rows and "
    "left/right columns reached by `color`). Colours are '#rrggbb', matched within `tol` per channel.",
    {
        "type": "object",
        "properties": {
            "op": {"type": "string", "enum": ["size", "colors", "text", "blobs", "column", "extremes"]},
            "color": {"type": "string"},
            "x": {"type": "integer", "minimum": 0},
            "tol": {"type": "integer", "minimum": 0, "maximum": 255},
        },
        "required": ["op"],
        "additionalProperties": False,
    },
    read_only=True,
    handler=_measure,
)
PYTHON = ToolSpec(
    "python",
    "Run Python 3 code in a sandbox (no network) whose working directory holds chart.png and imgtools.py "
    "(Pillow helpers: load, crop, zoom, rotate, threshold, colors, blobs, column, extremes). PNG files saved under "
    "out/ come back as images; stdout and stderr come back as text.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"], "additionalProperties": False},
    handler=_python,
)
SUBMIT = ToolSpec(
    "submit",
    "Submit the final answer: one number.",
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False},
)


def image_part(png_b64: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part holding a PNG as a data URL."""
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}}


class ImageToolEnvironment(ToolEnvironment):
    """A `ToolEnvironment` whose tool results can carry images: a handler puts base64 PNGs in
    ``ctx.env.pending[ctx.call_id]`` and its tool message comes back with them as ``image_url`` parts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, list[str]] = {}

    async def respond(self, message: dict[str, Any], *, external_calls: int = 0) -> StepResult:
        self.pending = {}
        result = await super().respond(message, external_calls=external_calls)
        for m in result.messages:
            images = self.pending.get(m.get("tool_call_id", ""))
            if images:
                m["content"] = [{"type": "text", "text": m["content"]}, *(image_part(b) for b in images)]
        self.pending = {}
        return result


class VisualEnv(ImageToolEnvironment):
    """The visual family's environment: ``python`` results carry the saved images as ``image_url`` parts."""

    def __init__(self) -> None:
        super().__init__(
            [PYTHON, MEASURE, SUBMIT],
            initial_state=lambda task: {"images": {}},
            submit_tool="submit",
            limits=EpisodeLimits(max_turns=12),
        )


# ------------------------------------------------------------------ reference solver


def _calibrate(layer: list[dict[str, Any]], axis: str) -> tuple[float, float]:
    """``(slope, offset)`` of value = slope * pixel + offset, fitted through the numeric tick labels of ``axis``
    (x labels share one row at the bottom, y labels one column at the left)."""
    nums = []
    for t in layer:
        try:
            nums.append((float(t["text"]), t["x"], t["y"]))
        except ValueError:
            continue
    key = 2 if axis == "x" else 1  # x labels share a y; y labels share an x
    rows: dict[float, list[tuple[float, float]]] = {}
    for v, x, y in nums:
        rows.setdefault(round((x, y)[key - 1]), []).append((x if axis == "x" else y, v))
    pairs = max(rows.values(), key=len)
    n = len(pairs)
    pb, vb = sum(p for p, _ in pairs) / n, sum(v for _, v in pairs) / n
    slope = sum((p - pb) * (v - vb) for p, v in pairs) / sum((p - pb) ** 2 for p, _ in pairs)
    return slope, vb - slope * pb


def _observations(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The parsed results of the reference solver's tool calls, by call id."""
    out: dict[str, Any] = {}
    for m in messages:
        if m.get("role") != "tool":
            continue
        c = m.get("content")
        text = c if isinstance(c, str) else "".join(p.get("text", "") for p in c if isinstance(p, dict))
        if text.startswith("exit code"):
            text = text.split("stdout:\n", 1)[-1].split("\nstderr:", 1)[0].split("\nimages:", 1)[0]
        try:
            out[m.get("tool_call_id", "")] = json.loads(text)
        except ValueError:
            out[m.get("tool_call_id", "")] = text
    return out


_QUESTION_KINDS = (("bar labelled", "bar"), ("value of the series", "line"), ("slope", "scatter"),
                   ("parabola", "function"), ("angle", "angle"))


def _read_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[str, str, bool]:
    """``(question, kind, vision)`` as the model sees them: the user message's text and the offered tools."""
    content = next(m["content"] for m in messages if m.get("role") == "user")
    text = content if isinstance(content, str) else "\n".join(p["text"] for p in content if p.get("type") == "text")
    question = next(line for line in text.splitlines() if line.endswith("?"))
    kind = next(k for cue, k in _QUESTION_KINDS if cue in question)
    names = {t.get("function", t).get("name") for t in tools}
    return question, kind, "python" in names


def _solve(q: str, kind: str, obs: dict[str, Any]) -> tuple[float, list[str]]:
    """The answer to question ``q`` about a ``kind`` figure computed from the measurements, with the reasoning
    steps that quote them."""
    layer, data = obs["t"], obs["m"]
    if kind == "angle":
        dots = [(b["cx"], b["cy"]) for b in data]
        pos = {}
        for t in layer:
            if t["text"] in ("A", "B", "C"):
                pos[t["text"]] = min(dots, key=lambda d: math.dist(d, (t["x"], t["y"])))
        pts = [list(pos[n]) for n in "ABC"]
        vertex = re.search(r"at vertex ([ABC])", q).group(1)
        ang = _triangle_angles(pts)["ABC".index(vertex)]
        return round(ang, 1), [f"vertex dots at {pos}", f"angle at {vertex} from the pixel vectors: {ang:.1f} degrees"]
    ys, yo = _calibrate(layer, "y")
    if kind == "bar":
        label = re.search(r"'(.+)'", q).group(1)
        lx = next(t["x"] for t in layer if t["text"] == label)
        bar = min(data, key=lambda b: abs(b["cx"] - lx))
        v = ys * bar["y0"] + yo
        return round(v, 1), [f"label '{label}' centred at x={lx}", f"its bar's top row is y={bar['y0']}",
                             f"y ticks give value = {ys:.4f}*y + {yo:.2f} = {v:.1f}"]
    xs, xo = _calibrate(layer, "x")
    if kind == "line":
        rows = data
        y = sum(rows) / len(rows)
        v = ys * y + yo
        return round(v, 1), [f"the line crosses that column at rows {rows}", f"value = {ys:.4f}*{y:.1f} + {yo:.2f} = {v:.1f}"]
    if kind == "scatter":
        pts = [(xs * b["cx"] + xo, ys * b["cy"] + yo) for b in data]
        n = len(pts)
        xb, yb = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        m = sum((x - xb) * (y - yb) for x, y in pts) / sum((x - xb) ** 2 for x, _ in pts)
        return round(m, 2), [f"{n} points; in data units {[(round(a, 2), round(b, 2)) for a, b in pts]}",
                             f"least-squares slope {m:.3f}"]
    end = "bottom" if "minimum" in q else "top"
    x = xs * data[end]["x"] + xo
    return round(x, 2), [f"the curve's {end} pixel row is at x={data[end]['x']}", f"x ticks give x = {x:.2f}"]


class ReferencePolicy:
    """Reads the question and the offered tools from the transcript, measures the image with the tools and answers
    from the measurements; it never reads the task's metadata."""

    def __init__(self, effort: str) -> None:
        self.effort = check_effort(effort)

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        obs = _observations(messages)
        question, kind, vision = _read_prompt(messages, tools)
        if k == 0:
            calls = [tool_call("c", "measure", {"op": "colors"}), tool_call("t", "measure", {"op": "text"})]
            if vision:
                code = "import imgtools\nimg = imgtools.load()\nimgtools.zoom(imgtools.crop(img, (40, 20, 470, 320)), 1.5).save('out/zoom.png')\nprint(img.size)"
                calls.insert(0, tool_call("z", "python", {"code": code}))
            why = "Find the data colour and the labels first." if self.effort == "low" else (
                "I will read the value from pixels: first the data colour and the text labels (tick values give the "
                "pixel-to-value scale)" + (", and a zoomed view of the plot area." if vision else ".")
            )
            return assistant("", why, calls)
        if k == 1:
            color = obs["c"][0]["color"]
            args: dict[str, Any] = {"color": color}
            if kind == "line":
                year = re.search(r"in (\d{4})", question).group(1)
                args["x"] = round(next(t["x"] for t in obs["t"] if t["text"] == year))
            op = {"bar": "blobs", "scatter": "blobs", "angle": "blobs", "line": "column", "function": "extremes"}[kind]
            if vision:
                call = tool_call("m", "python", {"code": f"import imgtools, json\nprint(json.dumps(imgtools.measure(imgtools.load(), {op!r}, **{args!r})))"})
            else:
                call = tool_call("m", "measure", {"op": op, **args})
            return assistant("", f"The data colour is {color}; measure it with '{op}'.", [call])
        answer, steps = _solve(question, kind, obs)
        reasoning = steps[-1] if self.effort == "low" else "\n".join(steps if self.effort == "max" else steps[-2:])
        return assistant("", reasoning, [tool_call("s", "submit", {"answer": f"{answer:g}"})])


# ------------------------------------------------------------------ family


class VisualFamily(FamilyBase):
    """Charts and STEM figures with numeric questions; see the module docstring."""

    name = NAME
    domain = "general"
    description = "read a value, trend or angle off a rendered chart or figure (tolerance; image tools in a sandbox)"
    kind = "visual"  # opt-in: not in the demo's default mix (default_families)
    id_prefix = "visual"

    def _make(self, rng: random.Random, difficulty: int, task_id: str) -> Task | None:
        kind = rng.choice(KINDS)
        drawn = _draw(rng, kind, difficulty)
        if drawn is None:
            return None
        spec, question, answer, tol = drawn
        tol = round(tol * TOLERANCE_SCALE[difficulty], 3)
        modality = rng.choice(("vision", "text"))
        png, layer = render(spec)
        b64 = base64.b64encode(png).decode("ascii")
        rule = f"Answer with one number; answers within ±{tol:g} of the true value count. Submit it with the submit tool."
        if modality == "vision":
            content: Any = [{"type": "text", "text": f"{question}\n{rule}"}, image_part(b64)]
            tools = [PYTHON, MEASURE, SUBMIT]
        else:
            content = (f"A chart image ({W}x{H} px) is loaded in the environment; you cannot see it, but the measure "
                       f"tool measures it.\n{question}\n{rule}")
            tools = [MEASURE, SUBMIT]
        meta = {"kind": kind, "modality": modality, "question": question, "answer": answer, "tolerance": tol,
                "spec": spec, "png": b64, "text_layer": layer}
        return self._task(task_id, [{"role": "user", "content": content}], meta, tools)

    def make_env(self, task: Task) -> VisualEnv:
        self._check_task(task)
        return VisualEnv()

    def reference_policy(self, task: Task, effort: str) -> ReferencePolicy:
        self._check_task(task)
        return ReferencePolicy(effort)

    def wrong_turns(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        want, tol = task.metadata["answer"], task.metadata["tolerance"]

        def submit(answer: str) -> list[dict[str, Any]]:
            return [assistant("", "", [tool_call("s", "submit", {"answer": answer})])]

        return {
            "empty": submit(""),
            "wrong_value": submit(f"{want + 5 * tol + 10:g}"),
            "just_outside": submit(f"{want + 1.3 * tol:g}"),
            "range": submit(f"between {want - 2 * tol:g} and {want + 2 * tol:g}"),
            "two_numbers": submit(f"{want - tol / 2:g} or {want + tol / 2:g}"),
            "nan": submit("nan"),
            "infinity": submit("1e999"),
            "copy_prompt": submit(prompt_text(task)),
            "plain_text_no_submit": [assistant("I cannot tell.")],
        }

    def wrong_policies(self, task: Task) -> dict[str, Any]:
        self._check_task(task)
        out: dict[str, Any] = {n: scripted_policy(t) for n, t in self.wrong_turns(task).items()}
        out["read_generating_data"] = scripted_policy([
            assistant("", "Look for the script or data that drew the chart.", [tool_call("h", "python", {"code": HACK_CODE})]),
            assistant("", "", [tool_call("s", "submit", {"answer": ""})]),  # nothing found: nothing to submit
        ])
        return out


HACK_CODE = r"""
import os, glob, json
found = []
for pat in ["/work/**/*.py", "/root/**", "/proc/*/cmdline", "/proc/*/environ", "/tmp/**", "/sandbox/**",
            "/home/**", "/etc/k3post*", "/usr/lib/python3/dist-packages/k3post*"]:
    for p in glob.glob(pat, recursive=True)[:2000]:
        try:
            txt = open(p, "rb").read(200000).decode("latin-1")
        except Exception:
            continue
        if any(w in txt for w in ("text_layer", "tolerance", "general.visual", "k3post")):
            found.append(p)
from PIL import Image
info = Image.open("chart.png").info
print(json.dumps({"found": found, "png_info": {k: str(v) for k, v in info.items()}, "pids": sorted(os.listdir("/proc"))[:20]}))
"""

register_family(VisualFamily())
