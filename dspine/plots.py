"""Charts as standalone SVG text (no plotting dependency): written beside result tables, opened in a browser."""

from __future__ import annotations

from html import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")


def line_panels(
    panels: list[tuple[str, dict[str, list[float]]]],
    x_label: str,
    y_max: float = 1.0,
    width: int = 360,
    height: int = 240,
    x: list[float] | None = None,
) -> str:
    """panels: (title, {series name: y values at x = 1, 2, ...}) side by side, one legend, y from 0 to y_max.
    `x`: the points' x values instead (shared by every series, increasing), placed to scale, 5 ticks."""
    names = list(dict.fromkeys(n for _, series in panels for n in series))
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    left, top, bottom, right = 40, 28, 34, 12
    pw, ph = width - left - right, height - top - bottom
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{height + 18 * len(names)}" '
        'font-family="sans-serif" font-size="11">'
    ]
    for p, (title, series) in enumerate(panels):
        x0 = p * width + left
        n = max((len(v) for v in series.values()), default=1)
        at = list(range(1, n + 1)) if x is None else x
        span = (at[0], max(at[-1], at[0] + 1e-9))

        def px(v: float) -> float:
            return x0 + pw * (v - span[0]) / (span[1] - span[0])

        xs = [px(v) for v in at]
        ticks = at if x is None else [span[0] + (span[1] - span[0]) * i / 4 for i in range(5)]

        def y(v: float) -> float:
            return top + ph * (1 - min(max(v / y_max, 0.0), 1.0))

        out.append(f'<text x="{x0}" y="16" font-weight="bold">{escape(title)}</text>')
        for t in (0.0, 0.25, 0.5, 0.75, 1.0):
            out.append(
                f'<line x1="{x0}" x2="{x0 + pw}" y1="{y(t * y_max):.1f}" y2="{y(t * y_max):.1f}" stroke="#ddd"/>'
                f'<text x="{x0 - 4}" y="{y(t * y_max) + 4:.1f}" text-anchor="end">{t * y_max:g}</text>'
            )
        for v in ticks:
            out.append(f'<text x="{px(v):.1f}" y="{top + ph + 14}" text-anchor="middle">{v:.3g}</text>')
        out.append(f'<text x="{x0 + pw / 2:.1f}" y="{top + ph + 28}" text-anchor="middle">{escape(x_label)}</text>')
        for name, vals in series.items():
            pts = " ".join(f"{xp:.1f},{y(v):.1f}" for xp, v in zip(xs, vals))
            out.append(
                f'<polyline fill="none" stroke="{color[name]}" stroke-width="2" points="{pts}">'
                f"<title>{escape(name)}</title></polyline>"
            )
    for i, name in enumerate(names):
        yy = height + 12 + 18 * i
        out.append(
            f'<rect x="{left}" y="{yy - 9}" width="14" height="4" fill="{color[name]}"/>'
            f'<text x="{left + 20}" y="{yy - 4}">{escape(name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
