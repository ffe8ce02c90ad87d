"""Charts as inline SVG, drawn on the server: no JavaScript, no chart library.

Every chart is an <svg role="img"> with a <title> and a <desc> that says every value in words, so a screen
reader gets the same facts as the picture. Colours come from CSS classes (site.css); the words next to each
bar carry the meaning, never the colour alone.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

_ids = count(1)

LABEL_W = 170  # px for the labels left of the bars
VALUE_W = 150  # px for the value written after a bar
ROW_H = 22
GROUP_H = 22
TOP = 26  # room for the markers' labels


@dataclass
class Bar:
    label: str
    value: float | None  # None: nothing measured (drawn as a note, not as a zero)
    css: str = ""
    text: str = ""  # written after the bar; defaults to the value
    ticks: list[tuple[float, str, str]] = field(default_factory=list)  # (value, css, title) small marks on the row


@dataclass
class Group:
    label: str
    bars: list[Bar]


@dataclass
class Segment:
    value: float
    css: str
    name: str


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"


def _px(value: float) -> str:
    return f"{value:.1f}"


def _svg(width: int, height: int, title: str, desc: str, body: Sequence[str]) -> SafeString:
    n = next(_ids)
    head = format_html(
        '<svg class="chart" role="img" aria-labelledby="chart{0}-title chart{0}-desc" viewBox="0 0 {1} {2}" '
        'width="{1}" height="{2}" xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMinYMin meet">'
        '<title id="chart{0}-title">{3}</title><desc id="chart{0}-desc">{4}</desc>',
        n, width, height, title, desc,
    )
    return mark_safe(head + "".join(body) + "</svg>")  # noqa: S308 (every piece was escaped by format_html)


def hbar_chart(groups: list[Group], *, title: str, max_value: float | None = None,
               markers: Sequence[tuple[float, str, str]] = (), width: int = 640, row_h: int = ROW_H) -> SafeString:
    """Horizontal bars in labelled groups, with optional vertical markers (value, label, css) across all rows."""
    values = [b.value for g in groups for b in g.bars if b.value is not None]
    top = max([*values, *(m[0] for m in markers), 0.0])
    scale_max = max_value if max_value is not None else (top * 1.05 or 1.0)
    scale_max = max(scale_max, top) or 1.0
    plot_w = width - LABEL_W - VALUE_W
    def x(v: float) -> float:
        return LABEL_W + plot_w * max(0.0, v) / scale_max

    body, said, y = [], [], TOP
    for group in groups:
        if group.label:
            body.append(format_html('<text x="0" y="{}" font-weight="600">{}</text>', y + 15, group.label))
            y += GROUP_H
        for bar in group.bars:
            mid = y + row_h / 2
            body.append(format_html('<text x="{}" y="{}" text-anchor="end">{}</text>', LABEL_W - 8, mid + 4,
                                    bar.label))
            if bar.value is None:
                text = bar.text or "not measured"
                body.append(format_html('<text x="{}" y="{}" class="muted" font-style="italic">{}</text>',
                                        LABEL_W + 4, mid + 4, text))
            else:
                text = bar.text or _fmt(bar.value)
                body.append(format_html(
                    '<rect class="bar {}" x="{}" y="{}" width="{}" height="{}" rx="2"><title>{}: {}</title></rect>',
                    bar.css, LABEL_W, y + 3, _px(max(x(bar.value) - LABEL_W, 1.0)), row_h - 6, bar.label, text))
            for value, css, tick_title in bar.ticks:
                body.append(format_html(
                    '<line class="marker {}" x1="{}" x2="{}" y1="{}" y2="{}"><title>{}</title></line>',
                    css, _px(x(value)), _px(x(value)), y + 1, y + row_h - 1, tick_title))
            if bar.value is not None:  # after the ticks, with a halo (site.css), so the ticks never hide it
                body.append(format_html('<text class="value" x="{}" y="{}">{}</text>', _px(x(bar.value) + 4),
                                        mid + 4, text))
            said.append(f"{group.label + ', ' if group.label else ''}{bar.label}: {text}")
            y += row_h
    for value, label, css in markers:  # drawn first: bars and words go over them
        body.insert(0, format_html('<line class="marker {}" x1="{}" x2="{}" y1="{}" y2="{}"/>',
                                   css, _px(x(value)), _px(x(value)), TOP - 6, y))
        body.append(format_html('<text x="{}" y="{}" text-anchor="middle" class="small">{}</text>',
                                _px(x(value)), TOP - 10, label))
    body.append(format_html('<line class="axis" x1="{}" x2="{}" y1="{}" y2="{}"/>', LABEL_W, LABEL_W, TOP - 4, y))
    return _svg(width, y + 8, title, "; ".join(said) + ".", body)


def stacked_bar_chart(rows: list[tuple[str, list[Segment]]], *, title: str, width: int = 640) -> SafeString:
    """One horizontal bar per row, split into segments (e.g. GPUs free / rented / unavailable)."""
    totals = [sum(s.value for s in segs) for _, segs in rows]
    scale_max = max([*totals, 1])
    plot_w = width - LABEL_W - VALUE_W
    body, said, y = [], [], 8
    for (label, segments), total in zip(rows, totals, strict=True):
        mid = y + ROW_H / 2
        body.append(format_html('<text x="{}" y="{}" text-anchor="end">{}</text>', LABEL_W - 8, mid + 4, label))
        left = float(LABEL_W)
        for seg in segments:
            if seg.value <= 0:
                continue
            w = plot_w * seg.value / scale_max
            body.append(format_html(
                '<rect class="bar {}" x="{}" y="{}" width="{}" height="{}"><title>{} {}</title></rect>',
                seg.css, _px(left), y + 3, _px(w), ROW_H - 6, _fmt(seg.value), seg.name))
            left += w
        parts = ", ".join(f"{_fmt(s.value)} {s.name}" for s in segments)
        body.append(format_html('<text x="{}" y="{}">{}</text>', _px(left + 4), mid + 4, _fmt(total)))
        said.append(f"{label}: {parts}")
        y += ROW_H
    if not rows:
        body.append(format_html('<text x="0" y="{}">{}</text>', y + 14, "Nothing to show yet."))
        y += ROW_H
    return _svg(width, y + 8, title, ("; ".join(said) or "Nothing to show yet") + ".", body)
