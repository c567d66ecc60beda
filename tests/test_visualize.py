"""visualize: every format writes what it claims, with nothing fetched from the network."""

import re
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch

import lucid_fx
from test_graph_model import Gate


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = Gate().eval()
    data = [torch.randn(8, 16) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    q = lucid_fx.convert(prepared)
    return model, prepared, q, lucid_fx.compare(model, q, data)


SVG = "{http://www.w3.org/2000/svg}"


def _node_groups(root):
    return [g for g in root.iter(SVG + "g") if g.get("class", "").startswith("node ")]


@pytest.mark.parametrize("layout", ["layered", "auto"])
def test_svg_has_one_group_per_node_coloured_by_domain(models, tmp_path, layout):
    _, prepared, _, _ = models
    out = lucid_fx.visualize(prepared, tmp_path / "g.svg", layout=layout)
    root = ET.parse(out).getroot()
    groups = _node_groups(root)
    g = lucid_fx.to_networkx(prepared)
    assert sorted(x.get("data-name") for x in groups) == sorted(g.nodes)
    tanh = [x for x in groups if x.get("data-name") == "tanh"][0]
    assert "domain-fixed" in tanh.get("class") and tanh.find(SVG + "rect").get("fill") == "#e1bee7"
    assert "FixedQParamsObserver" in tanh.find(SVG + "title").text
    assert len([p for p in root.iter(SVG + "path") if p.get("class") == "edge"]) == g.number_of_edges()


def test_html_is_self_contained_and_carries_every_attribute(models, tmp_path):
    model, _, q, comparison = models
    text = lucid_fx.visualize(q, tmp_path / "g.html", compare=comparison).read_text()
    assert re.findall(r"(?:src|href)\s*=\s*[\"']?(?:https?:)?//", text) == []
    assert "<script src" not in text and "@import" not in text and "<link" not in text
    assert text.count('<g class="node ') == lucid_fx.to_networkx(q).number_of_nodes()
    assert 'id="lucid-data"' in text and '"sqnr_db"' in text and '"lowering": "add"' in text
    assert '<option value="error" selected>' in text  # a comparison colours by error by default


def test_dot_and_graphml(models, tmp_path):
    _, prepared, q, comparison = models
    dot_text = lucid_fx.visualize(q, tmp_path / "g.dot", compare=comparison).read_text()
    assert dot_text.startswith('digraph "lucid_fx" {') and dot_text.count(" -> ") == lucid_fx.to_networkx(q).number_of_edges()
    assert '"lucid_sqnr_db"=' in dot_text
    back = nx.read_graphml(lucid_fx.visualize(prepared, tmp_path / "g.graphml"))
    assert back.nodes["softmax"]["domain"] == "fixed" and back.nodes["softmax"]["qparams"] == "scale=0.00390625 zp=0"


def test_error_colouring_follows_sqnr(models, tmp_path):
    _, _, q, comparison = models
    root = ET.parse(lucid_fx.visualize(q, tmp_path / "e.svg", compare=comparison, layout="layered")).getroot()
    fills = {x.get("data-name"): x.find(SVG + "rect").get("fill") for x in _node_groups(root)}
    measured = {r.measured: r.sqnr_db for r in comparison.rows}
    assert set(measured) <= set(fills)
    for name, db in measured.items():
        hue = float(fills[name][4:].split(",")[0])
        assert hue == pytest.approx(120 * min(1, max(0, (db - 15) / 25)), abs=0.5)
    assert fills["output"] == "#ffffff"  # not measured: no colour


def test_bad_arguments_are_named(models, tmp_path):
    _, prepared, _, _ = models
    with pytest.raises(ValueError, match=r"cannot write 'g.png': unknown suffix '.png'; use one of .dot, .graphml, .gv, .html, .svg"):
        lucid_fx.visualize(prepared, tmp_path / "g.png")
    with pytest.raises(ValueError, match="color_by='error' needs compare="):
        lucid_fx.visualize(prepared, tmp_path / "g.svg", color_by="error")
    with pytest.raises(ValueError, match="color_by must be 'domain' or 'error', got 'sqnr'"):
        lucid_fx.visualize(prepared, tmp_path / "g.svg", color_by="sqnr")
    assert not list(tmp_path.iterdir())  # nothing half-written
