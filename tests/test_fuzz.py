"""Property-based fuzzing of prepare -> calibrate -> convert on random small networks.

Networks are drawn by :func:`fuzz_programs.programs` (linear, conv1d/2d, relu, sigmoid, tanh,
softmax, add, mul, cat, flatten/reshape/view, transpose/permute, mean, max/avg/adaptive pooling,
in module, functional and method spellings; shapes consistent by construction). A falsifying
example prints its ``Program`` (replay: ``FuzzNet(Program(...))``) and, through ``note``, the
program as a listing and the int8 model's code.

More cases locally: ``LUCID_FX_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py``.
"""

import os

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import fx, nn

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx.kernels import weight_quant_range
from fuzz_programs import FuzzNet, Program, programs

# A profile of this module only (loading it globally would change other hypothesis tests).
settings.register_profile(
    "lucid_fx_fuzz",
    derandomize=True,  # the same cases on every run: CI is repeatable
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_SCALE = int(os.environ.get("LUCID_FX_FUZZ_EXAMPLES", "0")) or None


def fuzz_settings(examples: int) -> settings:
    return settings(settings.get_profile("lucid_fx_fuzz"), max_examples=_SCALE or examples)


_ACT = {"minmax_quint8": Q.quint8, "minmax_qint8": Q.qint8}


def _mapping(name: str) -> Q.QConfigMapping:
    if name == "histogram":
        return Q.get_default_qconfig_mapping()
    activation = Q.MinMaxObserver.with_args(qscheme=Q.per_tensor_affine, qdtype=_ACT[name])
    return Q.QConfigMapping().set_global(Q.QConfig(activation, Q.minmax_qconfig.weight))


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


# -- the error bound -----------------------------------------------------------------------------
# Inf-norm gain of each op on a perturbation of its (one) tensor input: d out <= gain * d in.
_GAIN = {
    "relu": 1.0, "tanh": 1.0, "flatten": 1.0, "reshape": 1.0, "view": 1.0, "getitem": 1.0,
    "transpose": 1.0, "permute": 1.0, "mean": 1.0, "contiguous": 1.0,
    "max_pool1d": 1.0, "max_pool2d": 1.0, "avg_pool1d": 1.0, "avg_pool2d": 1.0,
    "adaptive_avg_pool1d": 1.0, "adaptive_avg_pool2d": 1.0, "observer": 1.0,
    "quantize_per_channel": 1.0, "dequantize_per_channel": 1.0,  # weights: constants, error 0
    "sigmoid": 0.25,  # max of sigmoid'
    "softmax": 0.5,  # row sums of |J| = 2 p_i (1 - p_i) <= 1/2
}
_MODULES = {
    nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Softmax: "softmax", nn.Flatten: "flatten",
    nn.MaxPool1d: "max_pool1d", nn.MaxPool2d: "max_pool2d", nn.AvgPool1d: "avg_pool1d", nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d", nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.Linear: "linear", nn.Conv1d: "conv1d", nn.Conv2d: "conv2d",
}
_NOT_TENSORS = ("getattr", "size")
WEIGHT_RANGE = weight_quant_range("cpu")


def _on_weight_grid(weight: torch.Tensor, qmin: int, qmax: int) -> bool:
    """Whether every output channel of ``weight`` is ``codes * scale`` with integer codes in
    ``[qmin, qmax]`` (symmetric per channel: the largest code magnitude is ``qmax`` or ``-qmin``)."""
    rows = weight.detach().flatten(1).double()
    amax = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
    on = [((codes - codes.round()).abs() <= 1e-3).all(1) for codes in (rows / amax * qmax, rows / amax * -qmin)]
    return bool((on[0] | on[1]).all())


def _amax(t) -> float:
    return float(t.detach().float().abs().max()) if isinstance(t, torch.Tensor) and t.numel() else 0.0


class ErrorBound(fx.Interpreter):
    """Runs the reference (simulated) graph and carries two inf-norm error bounds per value:

    * ``eq``: |int8 model - reference|. At each ``quantize`` of the reference (scale ``s``, grid
      ``[lo, hi]``): ``eq_out = eq_in + s + clip``, where ``clip`` is how far the reference's own
      value lay outside ``[lo, hi]``. Sound whether the int8 model quantizes there (rounding of
      two values ``eq_in`` apart differs by at most ``eq_in + s``; clamping is 1-Lipschitz) or
      keeps that value float (then it differs by at most ``eq_in + s/2 + clip``). Between
      quantizations a bound grows by the op's inf-norm gain: ``max_o sum |W_ref[o]|`` for
      linear/conv, 1/4 sigmoid, 1/2 softmax, 1 relu/tanh/pooling/reshape, the sum for add,
      ``|a| eb + |b| ea + ea eb`` for mul, the max for cat; plus 1e-5 relative for float rounding.
      So one requantisation moves a value by at most one step, and each step is carried
      forward through the gains of the ops after it. This assumes the reference multiplies by
      the kernels' own weight codes, so that is checked too: every linear/conv weight of the
      reference lies on the per-channel grid of ``weight_quant_range``.
    * ``ef``: |reference - fp32|, sound when every fp32 value lies in its observed range (MinMax
      observers, evaluated on calibration data): ``ef_out = ef_in + s`` at each quantize, and
      linear/conv add ``max_o sum |W_ref[o] - W[o]| * (max |x_ref| + ef_in)`` for the weight codes.
    """

    def __init__(self, reference: fx.GraphModule, float_model: nn.Module) -> None:
        super().__init__(reference)
        self.float_model = float_model
        self.bound = {}

    def _name(self, node: fx.Node) -> str:
        if node.op == "call_module":
            module = self.module.get_submodule(node.target)
            return "observer" if isinstance(module, Q.ObserverBase) else _MODULES[type(module)]
        if node.op == "call_method":
            return node.target
        return getattr(node.target, "__name__", str(node.target)).split(".")[0]

    def _float_weight(self, node: fx.Node) -> torch.Tensor:
        if node.op == "call_module":
            return self.float_model.get_submodule(node.target).weight
        source = node.args[1]
        while source.op != "get_attr":  # through the weight's quantize -> dequantize
            source = source.args[0]
        return self.float_model.get_parameter(source.target)

    def run_node(self, node: fx.Node):
        out = super().run_node(node)
        ins = [n for n in node.all_input_nodes if isinstance(self.env.get(n), torch.Tensor)]
        eq, ef = (max((self.bound[n][k] for n in ins[:1]), default=0.0) for k in (0, 1))
        name = self._name(node) if node.op not in ("placeholder", "get_attr", "output") else node.op
        tol = 1e-6 * (1 + _amax(out))
        if node.op in ("placeholder", "get_attr", "output") or name in _NOT_TENSORS:
            eq = ef = 0.0
        elif name == "quantize_per_tensor":
            x, scale, zp, qmin, qmax = (self.env[a] if isinstance(a, fx.Node) else a for a in node.args[:5])
            clip = _amax(x - x.clamp((qmin - zp) * scale, (qmax - zp) * scale))
            eq, ef = eq + scale + clip, ef + scale
        elif name == "dequantize_per_tensor":
            pass
        elif name in ("linear", "conv1d", "conv2d"):
            weight = self.module.get_submodule(node.target).weight if node.op == "call_module" else self.env[node.args[1]]
            w_float = self._float_weight(node)
            assert _on_weight_grid(weight, *WEIGHT_RANGE), f"reference weight of {node.name} is not on the kernel's int8 grid"
            gain = float(weight.detach().flatten(1).abs().sum(1).max())
            drift = float((weight - w_float).detach().flatten(1).abs().sum(1).max())
            x = _amax(self.env[node.args[0]])
            eq, ef = gain * eq, gain * ef + drift * (x + ef)
            tol = 1e-5 * (gain * x + _amax(out) + 1)
        elif name in ("add", "mul"):
            tensors = [a for a in node.args if isinstance(a, fx.Node)]  # x + x counts x twice
            (ea, va), (eb, vb) = [(self.bound[n], _amax(self.env[n])) for n in tensors] + [((0.0, 0.0), 0.0)] * (2 - len(tensors))
            if len(tensors) == 1:  # a constant operand
                vb = abs(next(a for a in node.args if not isinstance(a, fx.Node)))
            if name == "add":
                eq, ef = ea[0] + eb[0], ea[1] + eb[1]
            else:
                eq, ef = (va * eb[k] + vb * ea[k] + ea[k] * eb[k] for k in (0, 1))
        elif name == "cat":
            eq, ef = (max(self.bound[n][k] for n in ins) for k in (0, 1))
        elif name in _GAIN:
            eq, ef = _GAIN[name] * eq, _GAIN[name] * ef
        else:
            raise KeyError(f"ErrorBound has no rule for node {node.name} ({node.op} {node.target})")
        self.bound[node] = (eq + tol, ef + tol)
        return out

    def output_bounds(self):
        (out,) = [n for n in self.module.graph.nodes if n.op == "output"]
        return [self.bound[n] for n in fx.node.map_arg(_tuple(out.args[0]), lambda n: n)]


# -- the properties ------------------------------------------------------------------------------


def _prepared(program: Program, qconfig: str):
    note(f"program ({qconfig}):\n{program}")
    model = FuzzNet(program).eval()
    batches = program.batches(3)
    prepared = lucid_fx.prepare(model, _mapping(qconfig), example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return model, prepared, batches[0]


@fuzz_settings(250)
@given(programs(), st.sampled_from(["minmax_quint8", "minmax_qint8"]))
def test_convert_stays_within_the_qparams_bound(program, qconfig):
    """prepare is exact; both converts run; |int8 - reference| <= eq and |int8 - fp32| <= eq + ef
    elementwise, with eq, ef the bounds of :class:`ErrorBound` read off the reference graph."""
    model, prepared, x = _prepared(program, qconfig)
    with torch.no_grad():
        fp32, observed = _tuple(model(x)), _tuple(prepared(x))
        assert all(torch.equal(a, b) for a, b in zip(fp32, observed)), "the prepared model changed the float outputs"
        reference = lucid_fx.convert(prepared, reference=True)
        qmodel = lucid_fx.convert(prepared)
        bound = ErrorBound(reference, model)
        ref, int8 = _tuple(bound.run(x)), _tuple(qmodel(x))
    note(f"int8 code:\n{qmodel.code}")
    for a, r, q, (eq, ef) in zip(fp32, ref, int8, bound.output_bounds()):
        assert q.shape == a.shape and q.dtype == torch.float32
        note(f"|int8 - ref| max {_amax(q - r):.3g} <= {eq:.3g}; |int8 - fp32| max {_amax(q - a):.3g} <= {eq + ef:.3g}")
        assert _amax(q - r) <= eq
        assert _amax(q - a) <= eq + ef


@fuzz_settings(80)
@given(programs())
def test_histogram_qconfig_convert_stays_within_the_reference_bound(program):
    """The default (histogram, clipping) QConfig: ranges may clip fp32 values, so only the int8
    vs reference bound holds; it accounts for the reference's own clipping."""
    model, prepared, x = _prepared(program, "histogram")
    with torch.no_grad():
        reference = lucid_fx.convert(prepared, reference=True)
        qmodel = lucid_fx.convert(prepared)
        bound = ErrorBound(reference, model)
        ref, int8 = _tuple(bound.run(x)), _tuple(qmodel(x))
    for r, q, (eq, _) in zip(ref, int8, bound.output_bounds()):
        assert _amax(q - r) <= eq
