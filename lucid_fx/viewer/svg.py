"""The laid-out graph as SVG: one ``<g class="node">`` per node (its attributes in ``data-``
fields and a ``<title>`` tooltip), one ``<path class="edge">`` per edge."""

from __future__ import annotations

from html import escape
from typing import Any, Dict, List, Tuple

import networkx as nx

from lucid_fx.layout import Layout
from lucid_fx.viewer.style import FONT_PX, LINE_HEIGHT, node_colors, node_lines

__all__ = ["render_svg"]

Point = Tuple[float, float]


def _path(points: List[Point], curved: bool) -> str:
    (x0, y0), rest = points[0], points[1:]
    parts = [f"M{x0:.1f},{y0:.1f}"]
    if curved and len(rest) % 3 == 0:  # dot's cubic Bezier control points
        for i in range(0, len(rest), 3):
            parts.append("C" + " ".join(f"{x:.1f},{y:.1f}" for x, y in rest[i : i + 3]))
        return " ".join(parts)
    prev = points[0]
    for x, y in rest:  # a vertical S-curve through each point of the polyline
        mid = (prev[1] + y) / 2
        parts.append(f"C{prev[0]:.1f},{mid:.1f} {x:.1f},{mid:.1f} {x:.1f},{y:.1f}")
        prev = (x, y)
    return " ".join(parts)


def _tooltip(attrs: Dict[str, Any]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in attrs.items())


def render_svg(g: nx.DiGraph, layout: Layout, *, color_by: str = "domain", standalone: bool = True) -> str:
    """SVG text of ``g`` placed by ``layout``; ``color_by`` is "domain" or "error"."""
    width, height = layout.width, layout.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="lucid-graph" viewBox="0 0 {width:.0f} {height:.0f}"'
        + (f' width="{width:.0f}" height="{height:.0f}"' if standalone else "")
        + f' font-family="ui-monospace, Menlo, Consolas, monospace" font-size="{FONT_PX:g}">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#607d8b"/></marker></defs>',
        '<g id="viewport"><g class="edges">',
    ]
    index = {node: i for i, node in enumerate(g.nodes)}
    for (u, v), points in layout.edges.items():
        out.append(
            f'<path class="edge" data-from="n{index[u]}" data-to="n{index[v]}" d="{_path(points, layout.curved)}" '
            'fill="none" stroke="#90a4ae" stroke-width="1.2" marker-end="url(#arrow)"/>'
        )
    out.append('</g><g class="nodes">')
    for node, attrs in g.nodes(data=True):
        cx, cy, w, h = layout.boxes[node]
        fill, stroke = node_colors(attrs, color_by)
        domain = escape(str(attrs.get("domain", "float")))
        out.append(
            f'<g class="node domain-{domain}" id="n{index[node]}" data-name="{escape(str(node))}" '
            f'transform="translate({cx - w / 2:.1f},{cy - h / 2:.1f})">'
            f"<title>{escape(_tooltip(attrs))}</title>"
            f'<rect width="{w:.1f}" height="{h:.1f}" rx="6" fill="{fill}" stroke="{stroke}" stroke-width="1.4"/>'
        )
        for i, line in enumerate(node_lines(attrs)):
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(f'<text x="9" y="{17 + i * LINE_HEIGHT:.0f}"{weight} fill="#212121">{escape(line)}</text>')
        out.append("</g>")
    out.append("</g></g></svg>")
    return "\n".join(out)
