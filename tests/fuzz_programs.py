"""Random small networks for the fuzz tests: a drawn "program" and the nn.Module that runs it.

A :class:`Program` is a list of :class:`Step` s; step ``i`` makes value ``i + 1`` from earlier
values (value 0 is the input). Every step is drawn only where its operands' shapes fit, so each
program runs by construction. ``repr(program)`` is valid Python in this module's namespace, so
a failing case is replayed with ``FuzzNet(eval(printed_repr))``; ``str(program)`` lists it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from hypothesis import reject
from hypothesis import strategies as st
from torch import nn

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Step:
    op: str
    inputs: Tuple[int, ...]
    spelling: str
    args: Dict[str, object] = field(default_factory=dict)
    shape: Shape = ()

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.op}[{self.spelling}]({', '.join(f'x{i}' for i in self.inputs)}{', ' if args else ''}{args}) -> {self.shape}"


@dataclass(frozen=True)
class Program:
    input_shape: Shape
    steps: Tuple[Step, ...]
    outputs: Tuple[int, ...]
    seed: int = 0
    input_scale: float = 1.0

    def __str__(self) -> str:
        lines = [f"x0 = input{self.input_shape} * {self.input_scale} (seed {self.seed})"]
        lines += [f"x{i + 1} = {step}" for i, step in enumerate(self.steps)]
        return "\n".join(lines + [f"return {', '.join(f'x{i}' for i in self.outputs)}"])

    def batches(self, count: int) -> List[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randn(self.input_shape, generator=gen) * self.input_scale for _ in range(count)]


ACT = ("module", "function", "torch", "method")
_ACT_FN = {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
_ACT_TORCH = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
_ACT_MODULE = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}
_POOLS = {
    "max_pool1d": (nn.MaxPool1d, F.max_pool1d), "avg_pool1d": (nn.AvgPool1d, F.avg_pool1d),
    "max_pool2d": (nn.MaxPool2d, F.max_pool2d), "avg_pool2d": (nn.AvgPool2d, F.avg_pool2d),
    "adaptive_avg_pool1d": (nn.AdaptiveAvgPool1d, F.adaptive_avg_pool1d),
    "adaptive_avg_pool2d": (nn.AdaptiveAvgPool2d, F.adaptive_avg_pool2d),
}


def _pick(draw, shapes: List[Shape], ranks=(2, 3, 4)) -> Optional[int]:
    choices = [i for i, s in enumerate(shapes) if len(s) in ranks]
    return draw(st.sampled_from(choices)) if choices else None


def _out_size(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def _linear(draw, shapes):
    i = _pick(draw, shapes)
    out = draw(st.integers(1, 8))
    args = {"in_features": shapes[i][-1], "out_features": out, "bias": draw(st.booleans())}
    return Step("linear", (i,), draw(st.sampled_from(["module", "function"])), args, shapes[i][:-1] + (out,))


def _conv(dims):
    def build(draw, shapes):
        i = _pick(draw, shapes, (dims + 2,))
        if i is None:
            return None
        n, c, *spatial = shapes[i]
        padding = draw(st.integers(0, 1))
        k = draw(st.integers(1, min(3, min(spatial) + 2 * padding)))
        stride = draw(st.integers(1, 2))
        groups = draw(st.sampled_from([1, c]))
        out = groups * draw(st.integers(1, 2)) if groups > 1 else draw(st.integers(1, 6))
        args = {"in_channels": c, "out_channels": out, "kernel_size": k, "stride": stride, "padding": padding, "groups": groups}
        shape = (n, out, *(_out_size(s, k, stride, padding) for s in spatial))
        return Step(f"conv{dims}d", (i,), draw(st.sampled_from(["module", "function"])), args, shape)

    return build


def _activation(name):
    def build(draw, shapes):
        i = _pick(draw, shapes)
        return Step(name, (i,), draw(st.sampled_from(ACT)), {}, shapes[i])

    return build


def _softmax(draw, shapes):
    i = _pick(draw, shapes)
    return Step("softmax", (i,), draw(st.sampled_from(ACT)), {"dim": draw(st.sampled_from([1, -1]))}, shapes[i])


def _binary(name):
    def build(draw, shapes):
        i = _pick(draw, shapes)
        same = [j for j, s in enumerate(shapes) if s == shapes[i]]
        if draw(st.booleans()):
            return Step(name, (i,), "constant", {"other": draw(st.sampled_from([0.5, -2.0, 3.0]))}, shapes[i])
        return Step(name, (i, draw(st.sampled_from(same))), draw(st.sampled_from(["operator", "torch"])), {}, shapes[i])

    return build


def _cat(draw, shapes):
    i = _pick(draw, shapes)
    dim = draw(st.sampled_from([1, -1]))
    d = dim % len(shapes[i])

    def fits(s):  # same rank, same sizes except along the cat dim
        return len(s) == len(shapes[i]) and all(a == b for k, (a, b) in enumerate(zip(s, shapes[i])) if k != d)

    others = draw(st.lists(st.sampled_from([j for j, s in enumerate(shapes) if fits(s)]), min_size=1, max_size=2))
    inputs = (i, *others)
    shape = list(shapes[i])
    shape[d] = sum(shapes[j][d] for j in inputs)
    return Step("cat", inputs, "torch", {"dim": dim}, tuple(shape))


def _flatten(draw, shapes):
    i = _pick(draw, shapes, (3, 4))
    if i is None:
        return None
    spelling = draw(st.sampled_from(["torch", "method", "module", "reshape", "view"]))
    return Step("flatten", (i,), spelling, {}, (shapes[i][0], math.prod(shapes[i][1:])))


def _unflatten(draw, shapes):
    i = _pick(draw, shapes, (2, 3))
    if i is None:
        return None
    *lead, last = shapes[i]
    first = draw(st.sampled_from([d for d in range(1, last + 1) if last % d == 0]))
    return Step("unflatten", (i,), draw(st.sampled_from(["reshape", "view"])), {}, (*lead, first, last // first))


def _transpose(draw, shapes):
    i = _pick(draw, shapes, (3, 4))
    if i is None:
        return None
    shape = list(shapes[i])
    shape[1], shape[-1] = shape[-1], shape[1]
    return Step("transpose", (i,), draw(st.sampled_from(["method", "torch", "permute"])), {}, tuple(shape))


def _mean(draw, shapes):
    i = _pick(draw, shapes)
    keepdim = draw(st.booleans())
    shape = shapes[i][:-1] + ((1,) if keepdim else ())
    if len(shape) < 2:
        return None
    return Step("mean", (i,), draw(st.sampled_from(["method", "torch"])), {"dim": -1, "keepdim": keepdim}, shape)


def _pool(name):
    dims = int(name[-2])

    def build(draw, shapes):
        i = _pick(draw, shapes, (dims + 2,))
        if i is None:
            return None
        n, c, *spatial = shapes[i]
        spelling = draw(st.sampled_from(["module", "function"]))
        if name.startswith("adaptive"):
            size = tuple(draw(st.integers(1, s)) for s in spatial)
            return Step(name, (i,), spelling, {"output_size": size if dims == 2 else size[0]}, (n, c, *size))
        k = draw(st.integers(1, min(3, min(spatial))))
        stride = draw(st.integers(1, k))
        shape = (n, c, *(_out_size(s, k, stride, 0) for s in spatial))
        return Step(name, (i,), spelling, {"kernel_size": k, "stride": stride}, shape)

    return build


BUILDERS = {
    "linear": _linear, "conv1d": _conv(1), "conv2d": _conv(2), "relu": _activation("relu"),
    "sigmoid": _activation("sigmoid"), "tanh": _activation("tanh"), "softmax": _softmax, "add": _binary("add"),
    "mul": _binary("mul"), "cat": _cat, "flatten": _flatten, "unflatten": _unflatten, "transpose": _transpose,
    "mean": _mean,
    **{name: _pool(name) for name in _POOLS},
}


@st.composite
def programs(draw, max_steps: int = 6) -> Program:
    rank = draw(st.sampled_from([2, 3, 4]))
    batch = draw(st.integers(1, 3))
    sizes = {2: [(1, 12)], 3: [(1, 4), (1, 10)], 4: [(1, 4), (1, 7), (1, 7)]}[rank]
    shapes = [(batch, *(draw(st.integers(lo, hi)) for lo, hi in sizes))]
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        step = BUILDERS[draw(st.sampled_from(sorted(BUILDERS)))](draw, shapes)
        if step is not None:
            steps.append(step)
            shapes.append(step.shape)
    extra = draw(st.lists(st.integers(0, len(shapes) - 2), max_size=1)) if len(shapes) > 1 else []
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    program = Program(shapes[0], tuple(steps), (len(shapes) - 1, *extra), seed, scale)
    if _view_of_strided(program):
        reject()
    return program


def _view_of_strided(program: Program) -> bool:
    """Whether the float model itself fails: a ``.view`` of a value whose strides it cannot view (a transpose's,
    or what an elementwise op made of one). Such a program is no model a user has (torch raises and says to use
    reshape; so does prepare), so the strategy draws another. Found by a 1500-example run."""
    if not any(step.spelling == "view" for step in program.steps):
        return False
    try:
        with torch.no_grad():
            FuzzNet(program)(program.batches(1)[0])
    except RuntimeError as error:
        if "view size is not compatible" in str(error):
            return True
        raise
    return False


class FuzzNet(nn.Module):
    """Runs a :class:`Program`; layers are seeded from ``program.seed``. Traceable by torch.fx (the
    loop over the program unrolls)."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.layers = nn.ModuleDict()
        self.weights = nn.ParameterDict()
        with torch.random.fork_rng():
            torch.manual_seed(program.seed)
            for index, step in enumerate(program.steps):
                self._build(f"s{index}", step)

    def _build(self, key: str, step: Step) -> None:
        a = step.args
        if step.op == "linear":
            layer = nn.Linear(a["in_features"], a["out_features"], bias=a["bias"])
        elif step.op.startswith("conv"):
            layer = (nn.Conv1d if step.op == "conv1d" else nn.Conv2d)(**a)
        elif step.op in _POOLS and step.spelling == "module":
            layer = _POOLS[step.op][0](**a)
        elif step.op in _ACT_MODULE and step.spelling == "module":
            layer = _ACT_MODULE[step.op]()
        elif step.op == "softmax" and step.spelling == "module":
            layer = nn.Softmax(a["dim"])
        elif step.op == "flatten" and step.spelling == "module":
            layer = nn.Flatten()
        else:
            return
        if step.spelling == "function":  # functional spellings read the parameters as graph constants
            self.weights[f"{key}_weight"] = layer.weight
            if layer.bias is not None:
                self.weights[f"{key}_bias"] = layer.bias
        else:
            self.layers[key] = layer

    def _run(self, key: str, step: Step, xs: List[torch.Tensor]) -> torch.Tensor:
        op, spelling, a, x = step.op, step.spelling, step.args, xs[0]
        if spelling == "module":
            return self.layers[key](x)
        if op in ("linear", "conv1d", "conv2d"):
            w, b = self.weights[f"{key}_weight"], self.weights[f"{key}_bias"] if f"{key}_bias" in self.weights else None
            if op == "linear":
                return F.linear(x, w, b)
            return getattr(F, op)(x, w, b, a["stride"], a["padding"], 1, a["groups"])
        if op in _ACT_FN:
            return {"function": _ACT_FN[op], "torch": _ACT_TORCH[op]}[spelling](x) if spelling != "method" else getattr(x, op)()
        if op == "softmax":
            return x.softmax(a["dim"]) if spelling == "method" else {"function": F.softmax, "torch": torch.softmax}[spelling](x, a["dim"])
        if op in ("add", "mul"):
            other = a["other"] if spelling == "constant" else xs[1]
            return (getattr(operator, op) if spelling in ("operator", "constant") else getattr(torch, op))(x, other)
        if op == "cat":
            return torch.cat(xs, a["dim"])
        if op == "flatten":
            if spelling in ("reshape", "view"):
                return getattr(x, spelling)(x.shape[0], -1) if spelling == "reshape" else x.view(x.size(0), -1)
            return torch.flatten(x, 1) if spelling == "torch" else x.flatten(1)
        if op == "transpose":
            if spelling == "permute":
                return x.permute(0, 2, 1) if len(step.shape) == 3 else x.permute(0, 3, 2, 1)  # swaps dims 1 and -1
            return x.transpose(1, -1) if spelling == "method" else torch.transpose(x, 1, -1)
        if op == "mean":
            return x.mean(a["dim"], keepdim=a["keepdim"]) if spelling == "method" else torch.mean(x, a["dim"], a["keepdim"])
        if op == "unflatten":
            return getattr(x, spelling)(x.shape[0], *step.shape[1:])
        return _POOLS[op][1](x, **a)

    def forward(self, x: torch.Tensor):
        values = [x]
        for index, step in enumerate(self.program.steps):
            values.append(self._run(f"s{index}", step, [values[i] for i in step.inputs]))
        outs = tuple(values[i] for i in self.program.outputs)
        return outs if len(outs) > 1 else outs[0]
