"""Minimal repros of issue 14's failure modes 3-5 and of new ones found by measure.py, each a few
lines, run against today's lucid_fx. Run from the repository root:

    python -m tests.models.repros

Each repro prints what happens; none of them asserts, since they document today's behaviour.
"""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx

X = torch.randn(2, 4)


class KeywordChild(nn.Module):
    """3a: the root is untraceable (data-dependent branch) and calls its child with a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: the root stays Python glue
            x = x + 1
        return self.inner(x=x)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x=None, scale=None):
        return self.fc(x) if scale is None else self.fc(x) * scale


class FlagChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, flag=None):
        if flag:  # needs concrete_args={"flag": None} to trace
            x = -x
        return torch.relu(self.fc(x))


class ConcreteTopOnly(nn.Module):
    """3b: concrete_args reach only the top-level trace, never a child the fallback prepares alone."""

    def __init__(self) -> None:
        super().__init__()
        self.block = FlagChild()

    def forward(self, x, flag=None):
        if x.sum() > 0:  # untraceable root
            x = x * 2
        return self.block(x)


class NoFixpoint(nn.Module):
    """4: silu -> gelu -> linear: the second activation is promoted (a quantized op reads it), the
    first is not (the sweep passed it before), so the table of the second declines too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(F.gelu(F.silu(self.fc1(x))))


class ReadsChildAttribute(nn.Module):
    """5: the untraceable root reads an attribute of a child that prepare replaced with a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)

    def forward(self, x):
        if x.mean() > 100:  # untraceable root
            x = x * 0
        y = self.conv1(x)
        return y[:, :, :: self.conv1.stride[0]]


class TupleConcat(nn.Module):
    """new: a tuple literal on the left of ``+`` (transformers' ``(hidden_states,) + outputs[1:]``,
    ``(-1,) + input_shape[1:]``) is canonicalised as a tensor add, and range analysis crashes on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        parts = self.fc(x).split(2, dim=-1)  # a Proxy, so the + below is traced (as operator.add)
        return (x,) + parts[1:]


def _run(model, example, prepare_options=None):
    stage = "prepare"
    try:
        prepared = lucid_fx.prepare(model.eval(), example_inputs=example, **(prepare_options or {}))
        stage = "calibrate"
        lucid_fx.calibrate(prepared, [example], progress=False)
        stage = "convert"
        return prepared, lucid_fx.convert(prepared)
    except Exception as exc:
        raise RuntimeError(f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


REPROS = {
    "3a keyword child": lambda: _run(KeywordChild(), (X,)),
    "3b concrete_args top level only": lambda: _run(ConcreteTopOnly(), (X,), {"concrete_args": {"flag": None}}),
    "4 no fixpoint": lambda: _run(NoFixpoint(), (X,)),
    "5 parent reads child attribute": lambda: _run(ReadsChildAttribute(), (torch.randn(1, 3, 8, 8),)),
    "new: tuple concatenation": lambda: _run(TupleConcat(), (X,)),
}


def main() -> None:
    for name, repro in REPROS.items():
        print(f"## {name}")
        try:
            prepared, qmodel = repro()
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            cause = exc.__cause__ or exc
            frame = traceback.extract_tb(cause.__traceback__)[-1]
            print(f"fails at {exc}\n  raised at {frame.filename.split('/')[-1]}:{frame.lineno}")
            continue
        print(f"prepare: {prepared.lucid_fx_report}")
        print(f"convert: {qmodel.lucid_fx_convert_report}")


if __name__ == "__main__":
    main()
