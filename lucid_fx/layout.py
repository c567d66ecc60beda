"""Graph layout for visualize: Graphviz ``dot`` for graphs it lays out in seconds, else a layered
layout in Python.

The Python layout is the classic Sugiyama scheme on the networkx graph: longest-path layers,
dummy nodes on edges that span layers, barycentre sweeps to reduce crossings (keeping the best
order seen), then x positions pulled towards neighbours without overlaps. Its time grows with
nodes plus dummies: a DenseNet-121 (571 nodes, 34,000 dummies) takes a few seconds.

dot's time grows much faster with the dummies (its network simplex places every one): it lays out
a ResNet-18 (70 nodes) in 0.1 s but ran past 120 s on that DenseNet-121. So "auto" asks dot only
for graphs of at most DOT_MAX_SPAN nodes plus dummies, and every dot run is bounded by a timeout
after which the layered layout takes over, with a warning and a note the viewer shows.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from bisect import bisect_right, insort
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Tuple

import networkx as nx

__all__ = ["Layout", "layered_layout", "dot_layout", "layout_graph", "count_crossings", "layout_span", "DOT_MAX_SPAN", "DOT_TIMEOUT_S"]

Size = Tuple[float, float]

#: "auto" uses dot up to this many nodes plus dummies (the layers all edges cross). dot's time
#: tracks it (measured on this project's 2-core machines, busy: 0.16 s at 800, a 500-node
#: ResNet-like chain; 1.0 s at 2,400 to 3,100; 4 to 5 s at 4,800 to 5,700; past 120 s at 35,000,
#: a DenseNet-121) while the layered layout stays at 0.4 to 1.4 s up to 5,000.
DOT_MAX_SPAN = 3000
#: dot runs longer than this are stopped and the layered layout is used instead.
DOT_TIMEOUT_S = 20.0


@dataclass
class Layout:
    """Node boxes (centre x, centre y, width, height) and edge routes (points, top to bottom)."""

    boxes: Dict[Hashable, Tuple[float, float, float, float]]
    edges: Dict[Tuple[Hashable, Hashable], List[Tuple[float, float]]]
    width: float
    height: float
    engine: str
    curved: bool = False  # dot gives cubic Bezier control points; the Python layout gives a polyline
    layers: List[List[Hashable]] = field(default_factory=list)
    note: str = ""  # why this engine, when it is not the one asked for (shown by the viewer)


def _layers(g: nx.DiGraph) -> Dict[Hashable, int]:
    layer: Dict[Hashable, int] = {}
    for node in nx.topological_sort(g):
        preds = [layer[p] for p in g.predecessors(node)]
        layer[node] = max(preds) + 1 if preds else 0
    # Inputs and constants sit just above their first consumer, not all at the top.
    for node in g.nodes:
        succs = [layer[s] for s in g.successors(node)]
        if g.in_degree(node) == 0 and succs:
            layer[node] = max(0, min(succs) - 1)
    return layer


def count_crossings(order: List[List[Hashable]], g: nx.DiGraph) -> int:
    """Edge crossings between consecutive layers of ``order``."""
    total = 0
    for upper, lower in zip(order, order[1:]):
        pos_l = {n: i for i, n in enumerate(lower)}
        # Edges sorted by (upper, lower) position: two cross when a later one ends further left,
        # so the crossings are the inversions of the lower ends (counted in E log E, not E^2).
        seen: List[int] = []
        for u in upper:
            ends = sorted(pos_l[v] for v in g.successors(u) if v in pos_l)
            for b in ends:
                total += len(seen) - bisect_right(seen, b)
            for b in ends:
                insort(seen, b)
    return total


def _with_dummies(g: nx.DiGraph, layer: Dict[Hashable, int]) -> Tuple[nx.DiGraph, Dict[Tuple, List[Hashable]]]:
    h = nx.DiGraph()
    h.add_nodes_from(g.nodes)
    chains: Dict[Tuple, List[Hashable]] = {}
    for u, v in g.edges:
        chain = [u]
        for k in range(layer[u] + 1, layer[v]):
            dummy = ("__dummy__", u, v, k)
            layer[dummy] = k
            chain.append(dummy)
        chain.append(v)
        for a, b in zip(chain, chain[1:]):
            h.add_edge(a, b)
        chains[(u, v)] = chain
    return h, chains


def _adjacency(h: nx.DiGraph) -> Tuple[Dict[Hashable, List[Hashable]], Dict[Hashable, List[Hashable]]]:
    # Plain lists: asking networkx for neighbours in the sweeps' inner loops cost half their time.
    return {n: list(h.predecessors(n)) for n in h.nodes}, {n: list(h.successors(n)) for n in h.nodes}


def _order(h: nx.DiGraph, layer: Dict[Hashable, int], sweeps: int) -> List[List[Hashable]]:
    depth = max(layer.values()) + 1 if layer else 0
    order: List[List[Hashable]] = [[] for _ in range(depth)]
    for node in nx.dfs_preorder_nodes(h, source=None):  # a depth-first start keeps chains together
        order[layer[node]].append(node)
    preds, succs = _adjacency(h)
    best, best_crossings = [list(row) for row in order], count_crossings(order, h)
    for sweep in range(sweeps):
        down = sweep % 2 == 0
        rows = range(1, depth) if down else range(depth - 2, -1, -1)
        neighbours = preds if down else succs
        for i in rows:
            ref = {n: j for j, n in enumerate(order[i - 1 if down else i + 1])}

            def key(item, ref=ref):
                j, node = item
                ps = [ref[p] for p in neighbours[node] if p in ref]
                return (sum(ps) / len(ps) if ps else j, j)

            order[i] = [n for _, n in sorted(enumerate(order[i]), key=key)]
        crossings = count_crossings(order, h)
        if crossings < best_crossings:
            best, best_crossings = [list(row) for row in order], crossings
    return best


def _place_x(order, h, sizes, gaps: Callable[[Hashable, Hashable], float], rounds: int = 12) -> Dict[Hashable, float]:
    x: Dict[Hashable, float] = {}
    for row in order:
        cursor = 0.0
        for i, node in enumerate(row):
            w = sizes[node][0]
            x[node] = cursor + w / 2
            cursor += w + (gaps(node, row[i + 1]) if i + 1 < len(row) else 0.0)
    preds, succs = _adjacency(h)
    near_of = {n: preds[n] + succs[n] for n in h.nodes}
    needs = [[(sizes[a][0] + sizes[b][0]) / 2 + gaps(a, b) for a, b in zip(row, row[1:])] for row in order]
    for r in range(rounds):
        rows = list(zip(order, needs)) if r % 2 == 0 else list(reversed(list(zip(order, needs))))
        for row, need in rows:
            want = []
            for node in row:
                near = near_of[node]
                want.append(sum(x[n] for n in near) / len(near) if near else x[node])
            # Two packings that keep the order and the gaps: pushed right of the wishes, and pulled
            # left of them. Their mean keeps both properties and is not biased to either side.
            right, left = list(want), list(want)
            for i in range(1, len(row)):
                right[i] = max(want[i], right[i - 1] + need[i - 1])
            for i in range(len(row) - 2, -1, -1):
                left[i] = min(want[i], left[i + 1] - need[i])
            placed = [(a + b) / 2 for a, b in zip(right, left)]
            for node, value in zip(row, placed):
                x[node] = value
    return x


def layered_layout(
    g: nx.DiGraph, size_of: Callable[[Hashable], Size], *, node_gap: float = 28, layer_gap: float = 36, sweeps: int = 12
) -> Layout:
    """Lay ``g`` (a DAG) out top to bottom; ``size_of(node)`` gives each box's (width, height)."""
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("layered_layout needs a DAG; torch.fx graphs always are")
    layer = _layers(g)
    h, chains = _with_dummies(g, layer)
    sizes = {n: (size_of(n) if n in g else (2.0, 0.0)) for n in h.nodes}

    def gaps(a: Hashable, b: Hashable) -> float:
        # Edges passing a layer (dummies) pack closer than boxes: DenseNet's concatenations send
        # a hundred edges past some layers, at node_gap apart the drawing was 4,500 px wide.
        real = (a in g) + (b in g)
        return node_gap if real == 2 else node_gap / 2 if real == 1 else node_gap / 4

    order = _order(h, layer, sweeps)
    x = _place_x(order, h, sizes, gaps)
    shift = min((x[n] - sizes[n][0] / 2 for n in h.nodes), default=0.0) - node_gap
    y, top = {}, node_gap
    for row in order:
        tallest = max((sizes[n][1] for n in row), default=0.0)
        for node in row:
            y[node] = top + tallest / 2
        top += tallest + layer_gap
    boxes = {n: (x[n] - shift, y[n], *sizes[n]) for n in g.nodes}
    edges = {}
    for (u, v), chain in chains.items():
        points = [(x[u] - shift, y[u] + sizes[u][1] / 2)]
        points += [(x[d] - shift, y[d]) for d in chain[1:-1]]
        points.append((x[v] - shift, y[v] - sizes[v][1] / 2))
        edges[(u, v)] = points
    width = max((b[0] + b[2] / 2 for b in boxes.values()), default=0.0) + node_gap
    real_order = [[n for n in row if n in g] for row in order]
    return Layout(boxes, edges, width, top, "layered", False, real_order)


def layout_span(g: nx.DiGraph) -> int:
    """Nodes plus dummies: the layers every edge crosses, which is what a layered layout places."""
    if not nx.is_directed_acyclic_graph(g):
        return g.number_of_nodes()
    layer = _layers(g)
    return g.number_of_nodes() + sum(max(0, layer[v] - layer[u] - 1) for u, v in g.edges)


def dot_layout(g: nx.DiGraph, size_of: Callable[[Hashable], Size], *, dot: str = "dot", timeout: float = DOT_TIMEOUT_S) -> Layout:
    """Lay ``g`` out with Graphviz ``dot`` (boxes of the given sizes), read back with ``-Tplain``.

    Raises ``subprocess.TimeoutExpired`` when dot runs longer than ``timeout`` seconds."""
    ids = {node: f"n{i}" for i, node in enumerate(g.nodes)}
    back = {v: k for k, v in ids.items()}
    lines = ["digraph G {", "  graph [rankdir=TB, nodesep=0.35, ranksep=0.5];", "  node [shape=box, fixedsize=true, label=\"\"];"]
    for node, ident in ids.items():
        w, h = size_of(node)
        lines.append(f"  {ident} [width={w / 72:.4f}, height={h / 72:.4f}];")
    lines += [f"  {ids[u]} -> {ids[v]};" for u, v in g.edges]
    lines.append("}")
    done = subprocess.run([dot, "-Tplain"], input="\n".join(lines), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"graphviz dot failed: {done.stderr.strip()[:300]}")
    boxes, edges = {}, {}
    height = width = 0.0
    pad = 12.0  # dot puts boxes flush with the drawing's edge
    for line in done.stdout.splitlines():
        parts = line.split()
        if parts[0] == "graph":
            width, height = float(parts[2]) * 72, float(parts[3]) * 72
        elif parts[0] == "node":
            node = back[parts[1]]
            cx, cy, w, h = (float(v) * 72 for v in parts[2:6])
            boxes[node] = (cx + pad, height - cy + pad, w, h)
        elif parts[0] == "edge":
            count = int(parts[3])
            coords = [float(v) * 72 for v in parts[4 : 4 + 2 * count]]
            route = [(coords[i] + pad, height - coords[i + 1] + pad) for i in range(0, len(coords), 2)]
            edges[(back[parts[1]], back[parts[2]])] = route
    return Layout(boxes, edges, width + 2 * pad, height + 2 * pad, "dot", True)


def layout_graph(
    g: nx.DiGraph, size_of: Callable[[Hashable], Size], engine: str = "auto", *, dot_timeout: float = DOT_TIMEOUT_S
) -> Layout:
    """``engine``: "dot" (needs Graphviz), "layered" (pure Python) or "auto" (dot if installed and the
    graph small enough for it, see :data:`DOT_MAX_SPAN`). A dot run past ``dot_timeout`` seconds
    gives way to the layered layout, with a warning; :attr:`Layout.note` says why."""
    if engine not in ("auto", "dot", "layered"):
        raise ValueError(f"unknown layout engine {engine!r}; use 'auto', 'dot' or 'layered'")
    dot = shutil.which("dot")
    if engine == "dot" and dot is None:
        raise RuntimeError("layout='dot' needs Graphviz's `dot` on PATH (apt install graphviz); or use layout='layered'")
    if engine == "layered" or dot is None:
        return layered_layout(g, size_of)
    span = layout_span(g)
    if engine == "auto" and span > DOT_MAX_SPAN:
        layout = layered_layout(g, size_of)
        layout.note = (f"layered layout: {g.number_of_nodes()} nodes whose edges cross {span} layers in all, past "
                       f"what Graphviz dot lays out in seconds ({DOT_MAX_SPAN}); layout='dot' forces it")
        return layout
    try:
        return dot_layout(g, size_of, dot=dot, timeout=dot_timeout)
    except subprocess.TimeoutExpired:
        note = (f"layered layout: Graphviz dot ran past {dot_timeout:g} s on {g.number_of_nodes()} nodes "
                f"(edges crossing {span} layers) and was stopped")
        warnings.warn(f"visualize: {note}", RuntimeWarning, stacklevel=3)
        layout = layered_layout(g, size_of)
        layout.note = note
        return layout
