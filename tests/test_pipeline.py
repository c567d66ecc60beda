"""The pipelines as data: the pass lists, the frozen contexts, and the loop's time/dump reports."""

import dataclasses
import re

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.pipeline import CONVERT_PASSES, PREPARE_PASSES, ENV_VAR, pass_name, run_passes


def test_the_pipelines_list_their_passes_in_order():
    assert [pass_name(p) for p in PREPARE_PASSES] == [
        "record_trace", "functionalize_inplace", "propagate_shapes", "decompose_attention", "decompose_einsum", "decompose_glu", "rewrite_weight_products", "canonicalize_ops",
        "remove_noops", "fold_constants", "rewrite_patterns", "fuse_patterns", "analyze_ranges", "choose_observers", "insert_observers",
    ]
    assert [pass_name(p) for p in CONVERT_PASSES] == [
        "narrow_fixed_grids", "fold_batchnorm", "lower", "fold_dequantize", "lower_recurrent", "record_activation_qparams",
        "install_programs",
    ]


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


def test_time_and_dump_report_each_pass_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv(ENV_VAR, "time,dump")
    prepared = lucid_fx.prepare(_model(), example_inputs=(torch.randn(2, 4),))
    err = capsys.readouterr().err
    timed = re.findall(r"lucid_fx pass (\w+): [0-9.]+ ms", err)
    assert timed == [pass_name(p) for p in PREPARE_PASSES]
    # the dump after insert_observers shows the observer calls it added, the one before does not
    before, after = err.split("lucid_fx graph after choose_observers:")[1].split("lucid_fx graph after insert_observers:")
    assert "lucid_fx_observers" not in before and "lucid_fx_observers" in after
    lucid_fx.calibrate(prepared, [torch.randn(2, 4)], progress=False)
    lucid_fx.convert(prepared)
    err = capsys.readouterr().err
    assert re.findall(r"lucid_fx pass (\w+): [0-9.]+ ms", err) == [pass_name(p) for p in CONVERT_PASSES]
    assert "torch.ops.lucid_fx.linear" in err.split("lucid_fx graph after lower:")[1]


def test_nothing_is_reported_unless_asked_and_unknown_values_are_refused(monkeypatch, capsys):
    monkeypatch.delenv(ENV_VAR, raising=False)
    lucid_fx.prepare(_model(), example_inputs=(torch.randn(2, 4),))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="unknown value.*'fast'; valid: time, dump"):
        run_passes(None, None, [], trace_passes="fast")
    assert run_passes("gm", None, [lambda gm, ctx: gm + "!"], trace_passes="") == "gm!"


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return self.inner(x)
        return self.inner(-x)


def test_a_nested_graph_runs_the_pipeline_with_its_own_path(monkeypatch, capsys):
    monkeypatch.setenv(ENV_VAR, "time")
    model = nn.Sequential(nn.Linear(4, 4), _Untraceable()).eval()
    lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
    err = capsys.readouterr().err
    assert "lucid_fx pass insert_observers [1.inner]:" in err and re.search(r"lucid_fx pass insert_observers: ", err)


def test_the_contexts_are_frozen():
    from lucid_fx.pipeline import ConvertContext, PrepareContext

    for cls in (PrepareContext, ConvertContext):
        assert cls.__dataclass_params__.frozen
    fields = {f.name for f in dataclasses.fields(PrepareContext)}
    assert {"registry", "qconfig_mapping", "target", "qat", "example_inputs", "trace"} <= fields
    assert {"registry", "target", "reference"} <= {f.name for f in dataclasses.fields(ConvertContext)}
