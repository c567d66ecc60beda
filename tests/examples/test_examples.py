"""Every example script runs in quick mode and produces what it claims."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_and_explain(capsys):
    table = _load("prepare_and_explain").main(quick=True)
    rows = table.by_node()
    assert rows["sigmoid"]["kind"] == "fixed" and rows["truediv"]["kind"] == "fixed"
    assert rows["conv"]["kind"] == "fused" and rows["relu"]["kind"] == "statistics"
    assert rows["pool"]["kind"] == "shared" and rows["flatten"]["kind"] == "shared"
    assert "summary:" in capsys.readouterr().out


def test_visualize_and_compare(capsys, tmp_path):
    errors = _load("visualize_and_compare").main(quick=True, out=tmp_path)
    out = capsys.readouterr().out
    assert errors.rows and errors.rows[0].sqnr_db == min(r.sqnr_db for r in errors.rows)
    assert all(r.sqnr_db > 20 for r in errors.rows) and errors.output_sqnr_db > 25
    assert f"worst node: {errors.rows[0].node} ({errors.rows[0].op}" in out
    assert "converted graph: boundary 2," in out and "int8 " in out
    for name in ("converted.html", "prepared.html", "converted.graphml"):
        assert (tmp_path / name).stat().st_size > 2000 and f"wrote {tmp_path / name}" in out
    assert '"sqnr_db"' in (tmp_path / "converted.html").read_text()
