"""The self-contained HTML viewer: the SVG, the node attributes as JSON, the viewer's script and
style inlined. Nothing is fetched over the network."""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any, Dict, Optional

import networkx as nx

from lucid_fx.layout import Layout
from lucid_fx.viewer.style import DOMAIN_COLORS, FONT_PX, error_color, node_colors
from lucid_fx.viewer.svg import render_svg

__all__ = ["render_html", "MIN_FONT_PX", "WORST"]

#: The page opens (and "fit" returns) at a zoom where node labels are at least this tall on
#: screen; smaller, a 1400x900 window showed the whole demo but no word of it could be read.
MIN_FONT_PX = 10.0
#: How many of the worst nodes the summary lists.
WORST = 5

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
  <button id="fit" title="as much of the graph as stays readable">fit</button>
  <button id="all" title="the whole graph, however small">all</button>
  <label>colour by <select id="color-by"><option value="domain"{domain_selected}>domain</option>{error_option}</select></label>
  <span id="legend"><span id="legend-domain">{legend_domain}</span><span id="legend-error">{legend_error}</span></span>
</header>
<main><div id="canvas">{svg}</div>
<aside id="side"><section id="summary">{summary}</section><section id="details" class="hidden"></section></aside></main>
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


def _link(ident: str, attrs: Dict[str, Any], extra: str) -> str:
    name, op = escape(str(attrs.get("name", ""))), escape(str(attrs.get("lowering") or attrs.get("op", "")))
    return f'<li><a href="#{ident}" class="goto" data-node="{ident}">{name}</a> <span>{op}{extra}</span></li>'


def _summary(g: nx.DiGraph, index: Dict[Any, str], output_sqnr_db: Optional[float], note: str) -> str:
    """The panel the page opens on: counts by domain, output SQNR, the worst (or float) nodes as links."""
    counts: Dict[str, int] = {}
    for _, attrs in g.nodes(data=True):
        counts[attrs.get("domain", "float")] = counts.get(attrs.get("domain", "float"), 0) + 1
    rows = "".join(
        f'<tr class="count-{escape(d)}"><td><i style="background:{DOMAIN_COLORS.get(d, DOMAIN_COLORS["float"])[0]}"></i>'
        f"{escape(d)}</td><td>{counts[d]}</td></tr>"
        for d in sorted(counts, key=lambda d: (-counts[d], d))
    )
    out = [f"<h2>{g.number_of_nodes()} nodes, {g.number_of_edges()} edges</h2><table id=\"counts\">{rows}</table>"]
    if output_sqnr_db is not None:
        out.append(f'<p id="output-sqnr">output SQNR vs fp32: <b>{output_sqnr_db:.1f} dB</b></p>')
    measured = sorted((a["sqnr_db"], n) for n, a in g.nodes(data=True) if "sqnr_db" in a)
    if measured:
        links = "".join(_link(index[n], g.nodes[n], f", {db:.1f} dB") for db, n in measured[:WORST])
        out.append(f'<h3>worst nodes (SQNR vs fp32)</h3><ol id="worst">{links}</ol>')
    else:
        floats = [n for n, a in g.nodes(data=True) if a.get("domain") == "float"]
        links = "".join(_link(index[n], g.nodes[n], "") for n in floats[:WORST])
        more = f" (first {WORST} of {len(floats)})" if len(floats) > WORST else ""
        out.append(f'<h3>float nodes{more}</h3><ol id="worst">{links}</ol>' if floats else "<p>no node runs in float</p>")
    if note:
        out.append(f'<p id="layout-note">{escape(note)}</p>')
    out.append('<p class="hint">Click a node for its details (Escape comes back here); drag to pan, wheel to zoom.</p>')
    return "".join(out)


def render_html(
    g: nx.DiGraph,
    layout: Layout,
    *,
    color_by: str = "domain",
    title: str = "lucid_fx graph",
    output_sqnr_db: Optional[float] = None,
) -> str:
    """One HTML file that shows ``g``: pan, zoom, search, a details panel, colour by domain or error.

    It opens on a summary (counts by domain, ``output_sqnr_db`` when given, the worst nodes as
    links) with the worst node, else the first input, in view at a readable zoom."""
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
    worst = min(((a["sqnr_db"], n) for n, a in g.nodes(data=True) if "sqnr_db" in a), default=None)
    first = next((n for n, a in g.nodes(data=True) if g.in_degree(n) == 0 and a.get("domain") == "io"), None)
    focus = worst[1] if worst else first if first is not None else next(iter(g.nodes), None)
    payload = {"nodes": nodes, "focus": index.get(focus), "minFontPx": MIN_FONT_PX, "fontPx": FONT_PX}
    data = json.dumps(payload, default=str).replace("</", "<\\/")
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
        summary=_summary(g, index, output_sqnr_db, layout.note),
    )
