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


def test_qat_recovers_accuracy(capsys):
    figures = _load("qat_recovers_accuracy").main(quick=True)
    assert figures["ptq_int8"] < figures["fp32"] - 0.2 < figures["qat_int8"]
    assert "qat_int8" in capsys.readouterr().out
