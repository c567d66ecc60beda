"""The graph as Graphviz DOT text, with the same labels and colours as the SVG."""

from __future__ import annotations

import networkx as nx

from lucid_fx.viewer.style import node_colors, node_lines

__all__ = ["render_dot"]


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(g: nx.DiGraph, *, color_by: str = "domain", name: str = "lucid_fx") -> str:
    """DOT text of ``g``: boxes labelled name / op / qparams, every attribute kept as a DOT attribute."""
    lines = [f"digraph {_quote(name)} {{", '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for node, attrs in g.nodes(data=True):
        fill, stroke = node_colors(attrs, color_by)
        if fill.startswith("hsl"):  # DOT has no hsl(): pass it as an HSV triple
            hue = float(fill[4:].split(",")[0]) / 360
            fill = f"{hue:.3f} 0.45 0.95"
        extra = ", ".join(f"{_quote('lucid_' + k)}={_quote(v)}" for k, v in attrs.items())
        label = "\\n".join(node_lines(attrs)).replace('"', "'")
        lines.append(f'  {_quote(node)} [label="{label}", fillcolor={_quote(fill)}, color={_quote(stroke)}, {extra}];')
    lines += [f"  {_quote(u)} -> {_quote(v)};" for u, v in g.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"
