"""The self-contained HTML viewer: the SVG, the node attributes as JSON, the viewer's script and
style inlined. Nothing is fetched over the network."""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any, Dict

import networkx as nx

from lucid_fx.layout import Layout
from lucid_fx.viewer.style import DOMAIN_COLORS, error_color, node_colors
from lucid_fx.viewer.svg import render_svg

__all__ = ["render_html"]

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style></head>
<body>
<header>
  <h1>{title}</h1>
  <input id="search" type="search" placeholder="search node or op, Enter to go" aria-label="search">
  <span id="found"></span>
  <button id="zoom-in" title="zoom in">+</button><button id="zoom-out" title="zoom out">&minus;</button>
  <button id="fit" title="whole graph">fit</button>
  <label>colour by <select id="color-by"><option value="domain"{domain_selected}>domain</option>{error_option}</select></label>
  <span id="legend"><span id="legend-domain">{legend_domain}</span><span id="legend-error">{legend_error}</span></span>
  <span>{summary}</span>
</header>
<main><div id="canvas">{svg}</div><aside id="details" class="hidden"></aside></main>
<script type="application/json" id="lucid-data">{data}</script>
<script>{js}</script>
</body></html>
"""


def _asset(name: str) -> str:
    return resources.files("lucid_fx.viewer").joinpath(name).read_text(encoding="utf-8")


def _legend_domain() -> str:
    return "".join(f'<span><i style="background:{fill}"></i>{name}</span>' for name, (fill, _) in DOMAIN_COLORS.items())


def _legend_error() -> str:
    return "".join(f'<span><i style="background:{error_color(db)}"></i>{db} dB</span>' for db in (40, 30, 20, 15))


def render_html(g: nx.DiGraph, layout: Layout, *, color_by: str = "domain", title: str = "lucid_fx graph") -> str:
    """One HTML file that shows ``g``: pan, zoom, search, a details panel, colour by domain or error."""
    index = {node: f"n{i}" for i, node in enumerate(g.nodes)}
    nodes: Dict[str, Any] = {}
    for node, attrs in g.nodes(data=True):
        nodes[index[node]] = {
            "attrs": attrs,
            "box": list(layout.boxes[node]),
            "inputs": [str(p) for p in g.predecessors(node)],
            "domainFill": node_colors(attrs, "domain")[0],
            "errorFill": error_color(attrs["sqnr_db"]) if "sqnr_db" in attrs else None,
        }
    has_error = any("sqnr_db" in a for _, a in g.nodes(data=True))
    data = json.dumps({"nodes": nodes}, default=str).replace("</", "<\\/")
    counts: Dict[str, int] = {}
    for _, attrs in g.nodes(data=True):
        counts[attrs.get("domain", "float")] = counts.get(attrs.get("domain", "float"), 0) + 1
    summary = f"{g.number_of_nodes()} nodes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return _PAGE.format(
        title=escape(title),
        css=_asset("viewer.css"),
        js=_asset("viewer.js"),
        svg=render_svg(g, layout, color_by=color_by, standalone=False),
        data=data,
        domain_selected="" if color_by == "error" else " selected",
        error_option='<option value="error"{}>error (SQNR)</option>'.format(" selected" if color_by == "error" else "")
        if has_error
        else "",
        legend_domain=_legend_domain(),
        legend_error=_legend_error(),
        summary=escape(summary),
    )
