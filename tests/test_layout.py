"""Graph layout: the Python layered layout and the Graphviz one give readable drawings."""

import os
import random
import shutil
import time
import warnings

import networkx as nx
import pytest
import torch

import lucid_fx
from lucid_fx.layout import DOT_MAX_SPAN, count_crossings, layered_layout, layout_graph, layout_span
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


def densenet_like_graph(blocks=(6, 12, 24, 16)) -> nx.DiGraph:
    """A converted DenseNet-121's wiring: each dense layer reads the concatenation of every earlier
    feature map of its block, and runs its standalone batch norm in float between a dequantize
    and a quantize (as lucid_fx converts torchvision's DenseNet)."""
    g = nx.DiGraph()

    def add(op, *inputs, domain="int8"):
        name = f"{op}_{g.number_of_nodes()}"
        g.add_node(name, name=name, op=op, domain=domain, qparams="scale=0.0123456 zp=128")
        g.add_edges_from((i, name) for i in inputs)
        return name

    def bn_relu(x):
        x = add("dequantize_per_tensor", add("contiguous", x), domain="boundary")
        x = add("quantize_per_tensor", add("batch_norm", x, domain="float"), domain="boundary")
        return add("contiguous", add("relu", x))

    x = add("max_pool2d", add("conv2d", add("quantize_per_tensor", add("input", domain="io"), domain="boundary")))
    for b, layers in enumerate(blocks):
        features = [x]
        for _ in range(layers):
            features.append(add("conv2d", add("conv2d", bn_relu(add("cat", *features)))))
        x = add("cat", *features)
        if b < len(blocks) - 1:
            x = add("avg_pool2d", add("conv2d", bn_relu(x)))
    add("output", add("linear", add("flatten", x)), domain="io")
    return g


@pytest.fixture(scope="module")
def densenet_graph():
    return densenet_like_graph()


def test_count_crossings_matches_the_definition():
    rng = random.Random(0)
    for trial in range(30):
        g = nx.gnp_random_graph(24, 0.3, seed=trial, directed=True)
        g = nx.DiGraph((u, v) for u, v in g.edges if u < v)
        order = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
        for row in order:
            rng.shuffle(row)
        brute = 0
        for upper, lower in zip(order, order[1:]):
            pairs = [(upper.index(u), lower.index(v)) for u in upper for v in g.successors(u) if v in lower]
            brute += sum(1 for a1, b1 in pairs for a2, b2 in pairs if a2 > a1 and b2 < b1)
        assert count_crossings(order, g) == brute


def test_layout_span_counts_the_layers_edges_cross():
    # a -> b -> c and a -> c: c sits two layers below a, so that edge crosses one layer.
    assert layout_span(nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])) == 4
    assert layout_span(nx.path_graph(5, create_using=nx.DiGraph)) == 5


def test_a_densenet_121_sized_graph_is_laid_out_in_seconds_without_dot(densenet_graph):
    g = densenet_graph
    assert 450 <= g.number_of_nodes() <= 600 and layout_span(g) > 10 * DOT_MAX_SPAN
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # choosing by size is no fallback: no warning
        layout = layout_graph(g, lambda n: node_size(g.nodes[n]), "auto")
    seconds = time.perf_counter() - start
    assert layout.engine == "layered" and seconds < 30, seconds
    if shutil.which("dot"):
        assert "past what Graphviz dot lays out in seconds" in layout.note
    _check_readable(g, layout)
    # Edges passing a layer pack closer than boxes: the widest layer holds ~120 of them.
    assert layout.width < 2500, layout.width


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


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed (.ci/run installs it)")
def test_dot_past_its_time_gives_way_to_the_layered_layout_with_a_warning(densenet_graph):
    g = densenet_graph  # dot ran past 120 s on this graph
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match=r"Graphviz dot ran past 0.5 s on 5\d\d nodes .* and was stopped"):
        layout = layout_graph(g, lambda n: node_size(g.nodes[n]), "dot", dot_timeout=0.5)
    assert layout.engine == "layered" and "dot ran past 0.5 s" in layout.note
    assert time.perf_counter() - start < 30
    _check_readable(g, layout)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed (.ci/run installs it)")
def test_auto_keeps_dot_for_graphs_it_lays_out_quickly(resnet_graph):
    g = resnet_graph
    assert layout_span(g) <= DOT_MAX_SPAN
    layout = layout_graph(g, lambda n: node_size(g.nodes[n]), "auto")
    assert layout.engine == "dot" and layout.note == ""


def test_dot_engine_without_graphviz_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt install graphviz.*layout='layered'"):
        layout_graph(nx.DiGraph([("a", "b")]), lambda n: (1.0, 1.0), "dot")
    assert layout_graph(nx.DiGraph([("a", "b")]), lambda n: (1.0, 1.0), "auto").engine == "layered"
