"""Graph layout: the Python layered layout and the Graphviz one give readable drawings."""

import os
import shutil

import networkx as nx
import pytest
import torch

import lucid_fx
from lucid_fx.layout import count_crossings, layered_layout, layout_graph
from lucid_fx.viewer.style import node_size
from models import ResNetLike


@pytest.fixture(scope="module")
def resnet_graph():
    torch.manual_seed(0)
    model = ResNetLike().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(1, 3, 64, 64),))
    return lucid_fx.to_networkx(prepared)


def _overlaps(layout):
    boxes = list(layout.boxes.values())
    found = 0
    for i, (x1, y1, w1, h1) in enumerate(boxes):
        for x2, y2, w2, h2 in boxes[i + 1 :]:
            if abs(x1 - x2) * 2 < w1 + w2 and abs(y1 - y2) * 2 < h1 + h2:
                found += 1
    return found


def _check_readable(g, layout):
    assert set(layout.boxes) == set(g.nodes) and set(layout.edges) == set(g.edges)
    assert _overlaps(layout) == 0
    for (u, v), points in layout.edges.items():
        assert layout.boxes[u][1] < layout.boxes[v][1], (u, v)  # every edge points down
        assert points[0][1] <= points[-1][1]
    for x, y, w, h in layout.boxes.values():
        assert 0 <= x - w / 2 and x + w / 2 <= layout.width and 0 <= y - h / 2 and y + h / 2 <= layout.height


def test_layered_layout_of_a_resnet_is_readable(resnet_graph):
    g = resnet_graph
    assert g.number_of_nodes() > 60  # a ResNet-18-like graph, residual adds and all
    layout = layered_layout(g, lambda n: node_size(g.nodes[n]))
    _check_readable(g, layout)
    # Residual blocks are drawn side by side: crossings stay few, far below the edge count.
    assert count_crossings(layout.layers, g) <= 2


def test_crossing_reduction_untangles_a_twisted_graph():
    # Two chains whose first layer is listed crossed: a0 feeds b1 and a1 feeds b0.
    g = nx.DiGraph([("a0", "b1"), ("a1", "b0"), ("b0", "c0"), ("b1", "c1"), ("c0", "d"), ("c1", "d")])
    layout = layered_layout(g, lambda n: (60.0, 30.0))
    assert count_crossings(layout.layers, g) == 0
    _check_readable(g, layout)


def test_sources_sit_just_above_their_first_consumer():
    g = nx.DiGraph([("x", "a"), ("a", "b"), ("b", "c"), ("w", "c")])
    layout = layered_layout(g, lambda n: (40.0, 20.0))
    assert layout.boxes["w"][1] == layout.boxes["b"][1]  # not at the top beside x


def test_layered_layout_refuses_cycles():
    with pytest.raises(ValueError, match="needs a DAG"):
        layered_layout(nx.DiGraph([("a", "b"), ("b", "a")]), lambda n: (10.0, 10.0))


def test_unknown_engine():
    with pytest.raises(ValueError, match="unknown layout engine 'neato'"):
        layout_graph(nx.DiGraph(), lambda n: (1.0, 1.0), "neato")


if shutil.which("dot") is None and os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
    raise RuntimeError("LUCID_FX_REQUIRE_TOOLS=1 but Graphviz dot is missing: apt install graphviz")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed (.ci/run installs it)")
def test_dot_layout_of_a_resnet_is_readable(resnet_graph):
    g = resnet_graph
    layout = layout_graph(g, lambda n: node_size(g.nodes[n]), "dot")
    assert layout.engine == "dot" and layout.curved
    _check_readable(g, layout)


def test_dot_engine_without_graphviz_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt install graphviz.*layout='layered'"):
        layout_graph(nx.DiGraph([("a", "b")]), lambda n: (1.0, 1.0), "dot")
    assert layout_graph(nx.DiGraph([("a", "b")]), lambda n: (1.0, 1.0), "auto").engine == "layered"
