"""Graph layout for visualize: Graphviz ``dot`` when it is installed, else a layered layout in Python.

The Python layout is the classic Sugiyama scheme on the networkx graph: longest-path layers,
dummy nodes on edges that span layers, barycentre sweeps to reduce crossings (keeping the best
order seen), then x positions pulled towards neighbours without overlaps. It reads well up to a
few hundred nodes, which covers a ResNet-sized graph.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Tuple

import networkx as nx

__all__ = ["Layout", "layered_layout", "dot_layout", "layout_graph", "count_crossings"]

Size = Tuple[float, float]


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
        pos_u = {n: i for i, n in enumerate(upper)}
        pos_l = {n: i for i, n in enumerate(lower)}
        edges = sorted((pos_u[u], pos_l[v]) for u in upper for v in g.successors(u) if v in pos_l)
        for i, (a1, b1) in enumerate(edges):
            for a2, b2 in edges[i + 1 :]:
                if a2 > a1 and b2 < b1:
                    total += 1
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


def _order(h: nx.DiGraph, layer: Dict[Hashable, int], sweeps: int) -> List[List[Hashable]]:
    depth = max(layer.values()) + 1 if layer else 0
    order: List[List[Hashable]] = [[] for _ in range(depth)]
    for node in nx.dfs_preorder_nodes(h, source=None):  # a depth-first start keeps chains together
        order[layer[node]].append(node)
    best, best_crossings = [list(row) for row in order], count_crossings(order, h)
    for sweep in range(sweeps):
        down = sweep % 2 == 0
        rows = range(1, depth) if down else range(depth - 2, -1, -1)
        for i in rows:
            ref = {n: j for j, n in enumerate(order[i - 1 if down else i + 1])}
            neighbours = h.predecessors if down else h.successors

            def key(item, ref=ref, neighbours=neighbours):
                j, node = item
                ps = [ref[p] for p in neighbours(node) if p in ref]
                return (sum(ps) / len(ps) if ps else j, j)

            order[i] = [n for _, n in sorted(enumerate(order[i]), key=key)]
        crossings = count_crossings(order, h)
        if crossings < best_crossings:
            best, best_crossings = [list(row) for row in order], crossings
    return best


def _place_x(order, h, sizes, gap: float, rounds: int = 12) -> Dict[Hashable, float]:
    x: Dict[Hashable, float] = {}
    for row in order:
        cursor = 0.0
        for node in row:
            w = sizes[node][0]
            x[node] = cursor + w / 2
            cursor += w + gap
    for r in range(rounds):
        rows = order if r % 2 == 0 else list(reversed(order))
        for row in rows:
            want = []
            for node in row:
                near = [x[n] for n in list(h.predecessors(node)) + list(h.successors(node))]
                want.append(sum(near) / len(near) if near else x[node])
            # Two packings that keep the order and the gaps: pushed right of the wishes, and pulled
            # left of them. Their mean keeps both properties and is not biased to either side.
            need = [(sizes[a][0] + sizes[b][0]) / 2 + gap for a, b in zip(row, row[1:])]
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
    g: nx.DiGraph, size_of: Callable[[Hashable], Size], *, node_gap: float = 28, layer_gap: float = 46, sweeps: int = 12
) -> Layout:
    """Lay ``g`` (a DAG) out top to bottom; ``size_of(node)`` gives each box's (width, height)."""
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("layered_layout needs a DAG; torch.fx graphs always are")
    layer = _layers(g)
    h, chains = _with_dummies(g, layer)
    sizes = {n: (size_of(n) if n in g else (2.0, 0.0)) for n in h.nodes}
    order = _order(h, layer, sweeps)
    x = _place_x(order, h, sizes, node_gap)
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


def dot_layout(g: nx.DiGraph, size_of: Callable[[Hashable], Size], *, dot: str = "dot") -> Layout:
    """Lay ``g`` out with Graphviz ``dot`` (boxes of the given sizes), read back with ``-Tplain``."""
    ids = {node: f"n{i}" for i, node in enumerate(g.nodes)}
    back = {v: k for k, v in ids.items()}
    lines = ["digraph G {", "  graph [rankdir=TB, nodesep=0.35, ranksep=0.5];", "  node [shape=box, fixedsize=true, label=\"\"];"]
    for node, ident in ids.items():
        w, h = size_of(node)
        lines.append(f"  {ident} [width={w / 72:.4f}, height={h / 72:.4f}];")
    lines += [f"  {ids[u]} -> {ids[v]};" for u, v in g.edges]
    lines.append("}")
    done = subprocess.run([dot, "-Tplain"], input="\n".join(lines), capture_output=True, text=True, timeout=120)
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


def layout_graph(g: nx.DiGraph, size_of: Callable[[Hashable], Size], engine: str = "auto") -> Layout:
    """``engine``: "dot" (needs Graphviz), "layered" (pure Python) or "auto" (dot if installed)."""
    if engine not in ("auto", "dot", "layered"):
        raise ValueError(f"unknown layout engine {engine!r}; use 'auto', 'dot' or 'layered'")
    dot = shutil.which("dot")
    if engine == "dot" and dot is None:
        raise RuntimeError("layout='dot' needs Graphviz's `dot` on PATH (apt install graphviz); or use layout='layered'")
    if engine == "dot" or (engine == "auto" and dot is not None):
        return dot_layout(g, size_of, dot=dot)
    return layered_layout(g, size_of)
