"""visualize: draw a prepared or converted model, the format chosen by the file's suffix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import networkx as nx
from torch import nn

from lucid_fx.graph_model import to_networkx
from lucid_fx.layout import layout_graph
from lucid_fx.viewer.dot import render_dot
from lucid_fx.viewer.html import render_html
from lucid_fx.viewer.style import node_size
from lucid_fx.viewer.svg import render_svg

__all__ = ["visualize", "FORMATS"]

#: suffix -> what it writes
FORMATS = {
    ".html": "a self-contained page: the SVG with pan/zoom, search and a details panel",
    ".svg": "the laid-out graph as SVG",
    ".dot": "Graphviz DOT text (also .gv)",
    ".gv": "Graphviz DOT text",
    ".graphml": "GraphML, every node attribute kept (for Gephi, yEd, networkx)",
}


def visualize(
    model: Union[nn.Module, nx.DiGraph],
    path: Union[str, Path],
    *,
    compare: Optional[Any] = None,
    layout: str = "auto",
    color_by: Optional[str] = None,
    title: Optional[str] = None,
) -> Path:
    """Write the graph of ``model`` to ``path`` as .html, .svg, .dot/.gv or .graphml.

    ``model`` is a prepared, converted or reference model (or a graph from :func:`to_networkx`).
    ``compare`` is a :func:`lucid_fx.compare` result: nodes then carry ``sqnr_db``/``max_abs`` and
    are coloured by error unless ``color_by="domain"``. ``layout``: "auto" (Graphviz ``dot`` when
    installed and the graph small enough for it to finish in seconds, else the Python layered
    layout), "dot" or "layered"; a dot run past :data:`lucid_fx.layout.DOT_TIMEOUT_S` gives way to the
    layered layout with a ``RuntimeWarning``. The .html page opens on a summary (counts by domain,
    the output SQNR and the five worst nodes given ``compare``) with the graph in view at a
    readable zoom. Returns the path written.

    >>> import torch, lucid_fx, tempfile, pathlib
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval()
    >>> prepared = lucid_fx.prepare(m, example_inputs=(torch.randn(2, 4),))
    >>> out = lucid_fx.visualize(prepared, pathlib.Path(tempfile.mkdtemp()) / "g.svg", layout="layered")
    >>> text = out.read_text()
    >>> text.count('<g class="node '), "FixedQParamsObserver" in text
    (4, True)
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"visualize: cannot write {path.name!r}: unknown suffix {suffix or '(none)'!r}; use one of {known}")
    if color_by not in (None, "domain", "error"):
        raise ValueError(f"visualize: color_by must be 'domain' or 'error', got {color_by!r}")
    graph = model if isinstance(model, nx.DiGraph) else to_networkx(model, comparison=compare)
    if color_by is None:
        color_by = "error" if compare is not None else "domain"
    if color_by == "error" and not any("sqnr_db" in a for _, a in graph.nodes(data=True)):
        raise ValueError("visualize: color_by='error' needs compare=lucid_fx.compare(float_model, quantized, inputs)")
    if suffix == ".graphml":
        nx.write_graphml(graph, path)
        return path
    if suffix in (".dot", ".gv"):
        path.write_text(render_dot(graph, color_by=color_by), encoding="utf-8")
        return path
    placed = layout_graph(graph, lambda n: node_size(graph.nodes[n]), layout)
    if suffix == ".svg":
        path.write_text(render_svg(graph, placed, color_by=color_by), encoding="utf-8")
    else:
        name = title or f"lucid_fx: {type(model).__name__}"
        output_sqnr = getattr(compare, "output_sqnr_db", None)
        page = render_html(graph, placed, color_by=color_by, title=name, output_sqnr_db=output_sqnr)
        path.write_text(page, encoding="utf-8")
    return path
