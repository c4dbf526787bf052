"""Image transforms and pixel measurements for the visual-reasoning family (Pillow only).

This one file serves twice: the environment's ``measure`` tool calls it in-process on the task's
PNG (numbers for text-only policies), and it is copied into every sandbox run of the ``python``
tool as ``imgtools.py`` (the sandbox's ``/usr/bin/python3`` has Debian's python3-pil), so a vision
policy crops, zooms, rotates and thresholds there and saves results under ``out/``.

Coordinates are pixels, origin top-left, x to the right, y down. A colour is ``"#rrggbb"``; a pixel
matches it when every channel differs by at most ``tol``.

    img = load("chart.png")
    zoom(crop(img, (40, 20, 240, 180)), 2).save("out/zoom.png")
    blobs(img, "#d62728")   # [{"x0", "y0", "x1", "y1", "cx", "cy", "n"}, ...] (8-connected)
"""

from __future__ import annotations

from typing import Any

from PIL import Image

__all__ = ["blobs", "colors", "column", "crop", "extremes", "load", "measure", "rotate", "threshold", "zoom"]


def load(path: str = "chart.png") -> Image.Image:
    """The image at ``path`` as RGB."""
    return Image.open(path).convert("RGB")


def crop(img: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    """The region ``(x0, y0, x1, y1)`` (x1, y1 exclusive)."""
    return img.crop(tuple(int(v) for v in box))


def zoom(img: Image.Image, factor: float) -> Image.Image:
    """``img`` scaled by ``factor`` (nearest neighbour, so colours stay exact)."""
    if not 0 < factor <= 8:
        raise ValueError(f"zoom factor must be in (0, 8], got {factor}")
    return img.resize((max(1, round(img.width * factor)), max(1, round(img.height * factor))), Image.NEAREST)


def rotate(img: Image.Image, degrees: float) -> Image.Image:
    """``img`` rotated counter-clockwise by ``degrees``, canvas expanded, white fill."""
    return img.rotate(degrees, resample=Image.NEAREST, expand=True, fillcolor=(255, 255, 255))


def threshold(img: Image.Image, level: int = 128) -> Image.Image:
    """Black where the grey level is below ``level``, white elsewhere."""
    return img.convert("L").point(lambda v: 0 if v < level else 255)


def _rgb(color: str) -> tuple[int, int, int]:
    c = color.strip().lstrip("#")
    if len(c) != 6:
        raise ValueError(f"colour must be '#rrggbb', got {color!r}")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def _matches(img: Image.Image, color: str, tol: int) -> set[tuple[int, int]]:
    r, g, b = _rgb(color)
    px = img.convert("RGB").load()
    w, h = img.size
    return {
        (x, y)
        for y in range(h)
        for x in range(w)
        if abs(px[x, y][0] - r) <= tol and abs(px[x, y][1] - g) <= tol and abs(px[x, y][2] - b) <= tol
    }


def colors(img: Image.Image, top: int = 8) -> list[dict[str, Any]]:
    """The ``top`` most frequent colours other than white, black and greys: ``[{"color", "n"}]``."""
    counts = img.convert("RGB").getcolors(maxcolors=1 << 24) or []
    out = [(n, c) for n, c in counts if max(c) - min(c) > 30]
    out.sort(key=lambda t: (-t[0], t[1]))
    return [{"color": "#%02x%02x%02x" % c, "n": n} for n, c in out[:top]]


def blobs(img: Image.Image, color: str, tol: int = 40, min_pixels: int = 4) -> list[dict[str, Any]]:
    """8-connected regions of ``color``, left to right: bounding box, centroid and pixel count."""
    todo = _matches(img, color, tol)
    out: list[dict[str, Any]] = []
    while todo:
        stack = [todo.pop()]
        comp = []
        while stack:
            x, y = stack.pop()
            comp.append((x, y))
            for dx in (-1, 0, 1):
                for dy in (-1, 0, 1):
                    q = (x + dx, y + dy)
                    if q in todo:
                        todo.remove(q)
                        stack.append(q)
        if len(comp) >= min_pixels:
            xs, ys = [p[0] for p in comp], [p[1] for p in comp]
            out.append(
                {"x0": min(xs), "y0": min(ys), "x1": max(xs), "y1": max(ys),
                 "cx": round(sum(xs) / len(xs), 2), "cy": round(sum(ys) / len(ys), 2), "n": len(comp)}
            )
    return sorted(out, key=lambda b: (b["cx"], b["cy"]))


def column(img: Image.Image, x: int, color: str, tol: int = 40) -> list[int]:
    """The rows ``y`` where column ``x`` has ``color``."""
    r, g, b = _rgb(color)
    px = img.convert("RGB").load()
    x = int(x)
    if not 0 <= x < img.width:
        raise ValueError(f"x={x} is outside the image (width {img.width})")
    return [y for y in range(img.height) if max(abs(px[x, y][0] - r), abs(px[x, y][1] - g), abs(px[x, y][2] - b)) <= tol]


def extremes(img: Image.Image, color: str, tol: int = 40) -> dict[str, Any]:
    """Where ``color`` reaches the top / bottom rows and the left / right columns.

    ``{"top": {"y", "x"}, "bottom": {"y", "x"}, "left": {"x", "y"}, "right": {"x", "y"}}``: the extreme row
    (column) and the mean position of the matching pixels on it.
    """
    pts = _matches(img, color, tol)
    if not pts:
        return {}

    def mean(vals: list[int]) -> float:
        return round(sum(vals) / len(vals), 2)

    y_top, y_bot = min(p[1] for p in pts), max(p[1] for p in pts)
    x_left, x_right = min(p[0] for p in pts), max(p[0] for p in pts)
    return {
        "top": {"y": y_top, "x": mean([p[0] for p in pts if p[1] == y_top])},
        "bottom": {"y": y_bot, "x": mean([p[0] for p in pts if p[1] == y_bot])},
        "left": {"x": x_left, "y": mean([p[1] for p in pts if p[0] == x_left])},
        "right": {"x": x_right, "y": mean([p[1] for p in pts if p[0] == x_right])},
    }


def measure(img: Image.Image, op: str, *, color: str = "", x: int = 0, tol: int = 40) -> Any:
    """One measurement by name: ``size``, ``colors``, ``blobs``, ``column`` or ``extremes``."""
    if op == "size":
        return {"width": img.width, "height": img.height}
    if op == "colors":
        return colors(img)
    if not color:
        raise ValueError(f"op {op!r} needs a colour '#rrggbb' (see op 'colors')")
    if op == "blobs":
        return blobs(img, color, tol)
    if op == "column":
        return column(img, x, color, tol)
    if op == "extremes":
        return extremes(img, color, tol)
    raise ValueError(f"unknown op {op!r}; expected size, colors, blobs, column, extremes (or text)")
