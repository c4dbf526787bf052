"""general.visual (issue 22): charts and STEM figures rendered with matplotlib, image tools in the sandbox,
a measurement tool for text-only policies, a tolerance verifier, reference solvers and hacks."""

from __future__ import annotations

import base64
import io
import json
import struct
import subprocess

import pytest

pytest.importorskip("matplotlib", reason="general.visual renders with matplotlib: pip install -e '.[visual]'")
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

from k3post.envs.episode import OpenAIPolicy, resume_episode_sync, run_episode_sync, to_openai_chat
from k3post.envs.families import default_families, get_family
from k3post.envs.families.visual import image as vi
from k3post.envs.families.visual.family import HACK_CODE, KINDS, parse_number
from k3post.envs.task import FinalState, Task, run_verifier
from k3post.tokenizer import IMAGE_TOKEN
from k3post.xtml import render_text

FAM = get_family("general.visual")
EFFORTS = ("low", "high", "max")


def _sandbox_has_pillow() -> bool:
    try:
        return subprocess.run(["/usr/bin/python3", "-c", "import PIL"], capture_output=True).returncode == 0
    except OSError:  # no /usr/bin/python3: the sandbox falls back to the host interpreter, see sandbox.py
        return False


needs_sandbox_pillow = pytest.mark.skipif(
    not _sandbox_has_pillow(), reason="the sandbox's /usr/bin/python3 has no Pillow: run scripts/install.sh (python3-pil)"
)


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return FAM.generate(30, seed=3, difficulty=2)  # seed 3: all 10 (kind, modality) pairs in 30 tasks


@pytest.fixture(scope="module")
def cover(tasks: list[Task]) -> dict[tuple[str, str], Task]:
    """One task per (kind, modality)."""
    out: dict[tuple[str, str], Task] = {}
    for t in tasks:
        out.setdefault((t.metadata["kind"], t.metadata["modality"]), t)
    assert set(out) == {(k, m) for k in KINDS for m in ("vision", "text")}, sorted(out)
    return out


def _run(policy, task):
    return run_episode_sync(policy, FAM.make_env(task), task)


def _png_chunks(data: bytes) -> list[str]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = [], 8
    while i < len(data):
        n = struct.unpack(">I", data[i : i + 4])[0]
        out.append(data[i + 4 : i + 8].decode())
        i += 12 + n
    return out


def test_generate_is_a_pure_function_of_seed_and_difficulty(tasks: list[Task]) -> None:
    again = FAM.generate(30, seed=3, difficulty=2)
    assert [t.content_hash() for t in again] == [t.content_hash() for t in tasks]
    assert FAM.generate(3, seed=4, difficulty=2)[0] != tasks[0]
    for d in (1, 3):
        assert len(FAM.generate(5, seed=0, difficulty=d)) == 5


def test_images_carry_no_metadata_and_the_prompt_no_hidden_data(cover: dict[tuple[str, str], Task]) -> None:
    """The PNG holds pixels only (no tEXt/iTXt/zTXt chunk with the data), and nothing of the generating data
    reaches the model's view: vision prompts carry the image as a data URL, text prompts only the question."""
    for (kind, modality), t in cover.items():
        png = base64.b64decode(t.metadata["png"])
        assert set(_png_chunks(png)) <= {"IHDR", "IDAT", "IEND", "PLTE"}, kind
        assert Image.open(io.BytesIO(png)).size == (480, 360)
        content = t.messages[0]["content"]
        if modality == "vision":
            assert content[1]["image_url"]["url"] == "data:image/png;base64," + t.metadata["png"]
            text = content[0]["text"]
            assert [s.name for s in t.tools] == ["python", "measure", "submit"]
        else:
            text = content
            assert [s.name for s in t.tools] == ["measure", "submit"]
        assert t.metadata["question"] in text and "±" in text
        assert json.dumps(t.metadata["spec"]) not in json.dumps(list(t.messages))


@needs_sandbox_pillow
@pytest.mark.parametrize("effort", EFFORTS)
def test_reference_solver_scores_1_on_every_kind_and_modality(cover: dict[tuple[str, str], Task], effort: str) -> None:
    for key, t in cover.items():
        ep = _run(FAM.reference_policy(t, effort), t)
        assert ep.reward == 1.0, (key, ep.verdict.diagnostics)


@needs_sandbox_pillow
def test_reference_solver_reads_the_image_not_the_hidden_data(cover: dict[tuple[str, str], Task]) -> None:
    """Replacing all the metadata but what the tools measure (the PNG and its text labels) leaves the reference's
    submission unchanged: it reads the question from the prompt and answers from its measurements."""
    for key, t in cover.items():
        d = t.to_dict()
        keep = {k: d["metadata"][k] for k in ("png", "text_layer")}
        d["metadata"] = dict(keep, answer=-999.0, tolerance=0.001, spec={}, kind="?", modality="?", question="?")
        poisoned = Task.from_dict(d)
        a = _run(FAM.reference_policy(t, "low"), t).verdict.diagnostics.split(",")[0]  # "answered <x>"
        b = _run(FAM.reference_policy(poisoned, "low"), poisoned)
        assert b.reward == 0.0 and b.verdict.diagnostics.split(",")[0] == a, key


@needs_sandbox_pillow
def test_every_wrong_or_hacky_policy_scores_0(cover: dict[tuple[str, str], Task]) -> None:
    for key in (("bar", "vision"), ("angle", "text"), ("function", "vision")):
        t = cover[key]
        pols = FAM.wrong_policies(t)
        assert {"empty", "wrong_value", "just_outside", "range", "two_numbers", "nan", "infinity", "copy_prompt",
                "read_generating_data"} <= set(pols)
        for name, pol in pols.items():
            ep = _run(pol, t)
            assert ep.reward == 0.0, (key, name, ep.verdict.diagnostics)


@needs_sandbox_pillow
def test_sandbox_hides_the_generating_script_data_and_host_processes(cover: dict[tuple[str, str], Task]) -> None:
    """The python tool's code sees chart.png and imgtools.py only: no k3post source, no task data, no host
    /proc entries (its own PID namespace), no metadata in the PNG."""
    t = cover[("line", "vision")]
    pol = FAM.wrong_policies(t)["read_generating_data"]
    ep = _run(pol, t)
    out = next(m["content"] for m in ep.messages if m.get("role") == "tool")
    assert out.startswith("exit code 0"), out
    seen = json.loads(out.split("stdout:\n", 1)[1].split("\nstderr:", 1)[0])
    # positive control: the search does find a file with those strings, its own source; nothing else
    assert seen["found"] == ["/sandbox/main.py"] and seen["png_info"] == {}
    assert len([p for p in seen["pids"] if p.isdigit()]) <= 3, seen["pids"]
    assert "general.visual" in HACK_CODE  # the hack looks for the family's own strings


def test_verifier_number_format_and_tolerance() -> None:
    # golden cases: one finite number, an optional degree sign; anything else is no answer
    assert parse_number("41.5") == 41.5 and parse_number(" -2.5 ") == -2.5 and parse_number(".5") == 0.5
    assert parse_number("62°") == 62.0 and parse_number("62 degrees") == 62.0
    for bad in ("", "nan", "inf", "1e999", "3 or 4", "between 1 and 2", "[3]", "about 4", "4.0.1", None):
        assert parse_number(bad) is None, bad
    t = FAM.generate(1, seed=0)[0]
    want, tol = t.metadata["answer"], t.metadata["tolerance"]

    def reward(answer: str, truncated: bool = False) -> float:
        return run_verifier(t, FinalState({"images": {}}, {"answer": answer}, truncated, "max_turns" if truncated else None)).reward

    assert reward(f"{want + tol * 0.999:.6f}") == 1.0 and reward(f"{want - tol * 0.999:.6f}") == 1.0
    assert reward(f"{want + tol * 1.001:.6f}") == 0.0
    assert reward(f"{want:g}", truncated=True) == 0.0
    assert run_verifier(t, FinalState({}, f"{want:g}")).reward == 1.0  # a plain-text final answer counts too


@needs_sandbox_pillow
def test_python_tool_returns_images_and_they_travel_in_xtml_and_openai_format(cover: dict[tuple[str, str], Task]) -> None:
    t = cover[("bar", "vision")]
    ep = _run(FAM.reference_policy(t, "max"), t)
    zoom = next(m for m in ep.messages if m.get("role") == "tool" and isinstance(m["content"], list))
    assert zoom["content"][0]["type"] == "text" and "out/zoom.png" in zoom["content"][0]["text"]
    url = zoom["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (645, 450)  # (430x300 crop) x 1.5
    # XTML: the prompt image and the tool's image each render as the K3 image placeholder
    assert render_text(ep.messages, tools=ep.tools).count(IMAGE_TOKEN) == 2
    # OpenAI chat: the tool message keeps the text, the image moves to a user message after the tool results
    msgs, _ = to_openai_chat(ep.messages, ep.tools)
    roles = [m["role"] for m in msgs]
    i = next(k for k, m in enumerate(msgs) if m["role"] == "tool" and "out/zoom.png" in m["content"])
    assert roles[i + 1 : i + 3] == ["tool", "tool"] and roles[i + 3] == "user"
    assert msgs[i + 3]["content"] == [zoom["content"][1]]
    assert all(isinstance(m["content"], str) for m in msgs if m["role"] == "tool")
    body = OpenAIPolicy("http://127.0.0.1:1", "vlm").request_body(ep.messages, ep.tools)
    assert json.dumps(body).count("data:image/png;base64,") == 2


def test_text_tasks_get_numbers_from_the_measure_tool(cover: dict[tuple[str, str], Task]) -> None:
    t = cover[("scatter", "text")]
    ep = _run(FAM.reference_policy(t, "high"), t)
    assert ep.reward == 1.0
    tool_text = [m["content"] for m in ep.messages if m.get("role") == "tool"]
    assert all(isinstance(c, str) for c in tool_text)
    blobs = json.loads(tool_text[2])
    assert len(blobs) == len(t.metadata["spec"]["xs"]) and {"cx", "cy", "n"} <= set(blobs[0])
    assert render_text(ep.messages, tools=ep.tools).count(IMAGE_TOKEN) == 0


@needs_sandbox_pillow
def test_pause_and_resume_keeps_saved_images(cover: dict[tuple[str, str], Task]) -> None:
    t = cover[("angle", "vision")]
    pol = FAM.reference_policy(t, "high")
    paused = run_episode_sync(pol, FAM.make_env(t), t, pause_after=1)
    assert paused.paused
    done = resume_episode_sync(pol, FAM.make_env(t), json.loads(json.dumps(paused.checkpoint)))
    assert done.reward == 1.0


def test_image_toolkit_golden() -> None:
    # a 6x4 white image with a 2x2 red square at x 1..2, y 1..2 and a red pixel pair at x=5, y 0..1
    img = Image.new("RGB", (6, 4), (255, 255, 255))
    for x, y in [(1, 1), (2, 1), (1, 2), (2, 2), (5, 0), (5, 1)]:
        img.putpixel((x, y), (214, 39, 40))
    assert vi.blobs(img, "#d62728", min_pixels=1) == [
        {"x0": 1, "y0": 1, "x1": 2, "y1": 2, "cx": 1.5, "cy": 1.5, "n": 4},
        {"x0": 5, "y0": 0, "x1": 5, "y1": 1, "cx": 5.0, "cy": 0.5, "n": 2},
    ]
    assert vi.column(img, 2, "#d62728") == [1, 2]
    ext = vi.extremes(img, "#d62728")
    assert ext["top"] == {"y": 0, "x": 5.0} and ext["bottom"] == {"y": 2, "x": 1.5} and ext["left"] == {"x": 1, "y": 1.5}
    assert vi.colors(img) == [{"color": "#d62728", "n": 6}]
    assert vi.zoom(img, 2).size == (12, 8) and vi.rotate(img, 90).size == (4, 6)
    assert vi.crop(img, (1, 1, 3, 3)).getcolors() == [(4, (214, 39, 40))]
    assert sorted(vi.threshold(img, 128).getcolors()) == [(6, 0), (18, 255)]
    with pytest.raises(ValueError, match="needs a colour"):
        vi.measure(img, "blobs")


def test_visual_is_listed_but_opt_in_for_the_demo() -> None:
    from k3post.envs.families.cli import list_text

    assert "general.visual" in list_text("general")
    assert FAM.kind == "visual" and FAM not in default_families()


@needs_sandbox_pillow
def test_tasks_sample_renders_a_visual_task() -> None:
    from k3post.envs.families.cli import sample_text

    seed = next(s for s in range(20) if FAM.generate(1, seed=s)[0].metadata["modality"] == "vision")
    out = sample_text("general.visual", seed=seed, effort="low")
    assert "## verdict: reward 1" in out and IMAGE_TOKEN in out and 'tool="python"' in out
