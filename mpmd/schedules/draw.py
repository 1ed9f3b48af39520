"""Timeline pictures of a simulation (or of anything with per-actor (start, end, label) spans): one row per
actor, one box per task coloured by kind and labelled like ``0F3``. SVG is written directly; PNG needs
matplotlib (``pip install matplotlib``, in the ``examples`` extra)."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Sequence
from html import escape
from typing import Protocol

log = logging.getLogger(__name__)

# Colour per task kind (the F/B/I/W palette of torch.distributed.pipelining's visualizer family); step phases grey.
COLOURS = {"F": "#4c78a8", "B": "#54a24b", "I": "#f58518", "W": "#b279a2"}
OTHER = "#9d9d9d"
LEGEND = (("F", "forward"), ("B", "backward"), ("I", "input grad"), ("W", "weight grad"))


class Timeline(Protocol):
    """What a picture reads: a name, the step time and per-actor (start, end, label) spans (`mpmd.SimResult` has
    them, and so does a measured trace turned into one)."""

    name: str
    step_time: float
    timeline: Sequence[Sequence[tuple[float, float, str]]]

    @property
    def bubble(self) -> float: ...


def kind_of(label: str) -> str:
    """The colour class of a timeline label: its first task's kind (F, B, I, W), or the phase name."""
    m = re.match(r"^\d+([FBIW])\d+", label)
    return m.group(1) if m else label


def legend(result: Timeline) -> list[tuple[str, str]]:
    """The LEGEND entries of the task kinds the timeline shows (a zero-bubble table has no B: its legend listed one)."""
    shown = {kind_of(label) for spans in result.timeline for _, _, label in spans}
    return [(k, name) for k, name in LEGEND if k in shown] or list(LEGEND)


def colour(kind: str) -> str:
    """The fill colour of a task kind (F, B, I, W) or of any other label (grey)."""
    return COLOURS.get(kind, OTHER)


def draw_timeline(result: Timeline, path: str, title: str | None = None, fmt: str | None = None) -> None:
    """Write `result`'s timeline to `path` as `fmt` ("png", via matplotlib, or "svg", any case); None: from the path's
    ending, ``.png`` or ``.svg`` (another ending with no `fmt` is refused: it would hold the wrong format)."""
    title = result.name if title is None else title
    if fmt is None:
        ending = os.path.splitext(str(path))[1].lower()
        if ending not in (".png", ".svg"):
            raise ValueError(f"a timeline picture is written as .png or .svg; {str(path)!r:.120} ends in {ending or 'nothing'}: "
                             "name it .png or .svg, or pass fmt='png' / fmt='svg'")
        fmt = ending[1:]
    fmt = fmt.lower() if isinstance(fmt, str) else fmt
    if fmt not in ("png", "svg"):
        raise ValueError(f"a timeline picture is 'png' or 'svg', got fmt={fmt!r:.40}")
    if fmt == "png":
        _png(result, path, title)
    else:
        with open(path, "w") as f:
            f.write(svg(result, title))
    log.info("wrote timeline of %s to %s", title, path)


def _ticks(step: float) -> list[float]:
    """Axis ticks 0, u, 2u, ... up to `step`, u a round number (1, 2 or 5 times a power of ten) near step / 10;
    just 0 and the step where that unit is not a normal float (a step of a few subnormals)."""
    if not step > 0:
        return [0.0]
    raw = step / 10
    if raw < 1e-300:  # (10 ** floor(log10(raw)) would lose its digits, or raw is 0)
        return [0.0, step]
    mag = 10.0 ** math.floor(math.log10(raw))
    unit = next(u * mag for u in (1, 2, 5, 10) if u * mag >= raw)
    return [i * unit for i in range(int(step / unit) + 1)]


def svg(result: Timeline, title: str = "", span: float | None = None) -> str:
    """The timeline as an SVG document (a string); its axis runs from 0 to `span` (default: its step time)."""

    if not math.isfinite(result.step_time):
        raise ValueError(f"cannot draw a timeline whose step time is {result.step_time}; its costs overflowed")
    step = (span if span is not None and math.isfinite(span) and span >= result.step_time else result.step_time) or 1.0
    left, row_h, gap, width = 70, 28, 6, 1100
    top = 40
    usable = width - left - 20

    def at(t: float) -> float:  # (t / step first: usable / step overflows for a step of a few subnormals)
        return left + t / step * usable
    height = top + result.num_actors * (row_h + gap) + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{escape(title)}  (step {result.step_time:.7g}, bubble {result.bubble:.3f})</text>']
    for a, spans in enumerate(result.timeline):
        y = top + a * (row_h + gap)
        out.append(f'<text x="8" y="{y + row_h / 2 + 4}">actor {a}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{usable:.2f}" height="{row_h}" fill="#f2f2f2"/>')
        for s, e, label in spans:
            x, w = at(s), max(at(e) - at(s), 0.5)
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{colour(kind_of(label))}" '
                       f'stroke="white" stroke-width="0.5"><title>{escape(label)} [{s:g}, {e:g}]</title></rect>')
            if w >= 6.5 * len(label):
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 4}" fill="white" text-anchor="middle">{escape(label)}</text>')
    axis_y = top + result.num_actors * (row_h + gap) + 4
    for t in _ticks(step):
        x = at(t)
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="black"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{t:g}</text>')
    for k, (kind, name) in enumerate(legend(result)):
        x = left + k * 130
        out.append(f'<rect x="{x}" y="{axis_y + 28}" width="12" height="12" fill="{COLOURS[kind]}"/>')
        out.append(f'<text x="{x + 16}" y="{axis_y + 38}">{kind}: {name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png(result: Timeline, path: str, title: str) -> None:

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"drawing {path} as PNG needs matplotlib (pip install matplotlib); or pass a path ending in .svg, "
                          "which needs nothing") from None
    fig, ax = plt.subplots(figsize=(14, 0.6 * result.num_actors + 1.2))
    for a, spans in enumerate(result.timeline):
        for s, e, label in spans:
            ax.barh(a, e - s, left=s, height=0.8, color=colour(kind_of(label)), edgecolor="white", linewidth=0.5)
            if (e - s) / (result.step_time or 1) > 0.012 * len(label) / 3:
                ax.text((s + e) / 2, a, label, ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(result.num_actors), [f"actor {a}" for a in range(result.num_actors)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.step_time or 1)  # (from 0, as the SVG: a lead before the first task is part of the step)
    ax.set_xlabel("time")
    from matplotlib.patches import Patch

    shown = legend(result)
    ax.legend(handles=[Patch(color=COLOURS[k], label=f"{k}: {name}") for k, name in shown], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if result.num_actors > 2 else -0.45), ncol=len(shown), fontsize=8, frameon=False)
    ax.set_title(f"{title}  (step {result.step_time:.7g}, bubble {result.bubble:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # (what was asked, whatever the path ends in)
    plt.close(fig)


def draw_stacked(results: list[Timeline], titles: list[str], path: str) -> None:
    """Several timelines one above the other in one SVG (e.g. simulated above measured), on one time axis: the
    longest step's (each was drawn to its own, and a 5.9 ms simulated step looked as long as an 8.3 ms measured
    one: a probe)."""
    span = max((r.step_time for r in results if math.isfinite(r.step_time)), default=None)
    docs = [svg(r, t, span) for r, t in zip(results, titles)]
    heights = [int(d.split('height="', 1)[1].split('"', 1)[0]) for d in docs]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="1100" height="{sum(heights)}">']
    y = 0
    for d, h in zip(docs, heights):
        out.append(d.replace("<svg ", f'<svg y="{y}" ', 1))
        y += h
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
