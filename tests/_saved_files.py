"""Real saved files to tamper with (test_load_checks.py, test_load_fuzz.py), and a canary.

Each model kind is written once by ``lucid_fx.save``; a test edits the raw data that
``torch.load(weights_only=True)`` returns and writes it back. The canary is what a crafted file
would run if the loader ever ran code a file names: it appends to ``FIRED`` and writes a file.
"""

import copy
import functools
import io
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q

FIRED = []  # the canary's record: empty unless code from a file ran
CANARY_FILE = os.path.join(tempfile.gettempdir(), f"lucid_fx_canary_{os.getpid()}")
# Python source a crafted file asks exec/eval to run: it sets a global here and writes a file.
CANARY_CODE = f"__import__('_saved_files').FIRED.append('exec'); open({CANARY_FILE!r}, 'w').write('ran')"


def fire(*args, **kwargs):
    """A call target a crafted file names ("_saved_files.fire"): never resolvable by load."""
    FIRED.append("fire")
    with open(CANARY_FILE, "w") as f:
        f.write("ran")
    return args[0] if args else None


def canary_fired() -> bool:
    return bool(FIRED) or os.path.exists(CANARY_FILE)


def reset_canary() -> None:
    FIRED.clear()
    if os.path.exists(CANARY_FILE):
        os.remove(CANARY_FILE)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 6)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


class Bounded(nn.Module):  # fixed-qparams ops: sigmoid, tanh, softmax
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.sigmoid(self.fc1(x)) * torch.tanh(x)
        return F.softmax(self.fc2(h), dim=-1)


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, *shape, generator=gen) * (1 + i % 3) for i in range(n)]


_MINMAX = Q.QConfigMapping().set_global(Q.minmax_qconfig)


def _calibrated(factory, shape):
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(factory().eval(), _MINMAX, example_inputs=tuple(batches(shape, 1, seed=9)))
    lucid_fx.calibrate(prepared, batches(shape, 3), progress=False)
    return prepared


def _qat():
    torch.manual_seed(0)
    qat = lucid_fx.prepare_qat(mlp().train(), example_inputs=(torch.randn(4, 8),))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt = torch.optim.SGD(qat.parameters(), lr=0.1)
    F.cross_entropy(qat(x), target).backward()
    opt.step()
    return qat


# name -> (build the model, input shape without the batch dimension)
KINDS = {
    "mlp": (lambda: lucid_fx.convert(_calibrated(mlp, (8,))), (8,)),
    "cnn": (lambda: lucid_fx.convert(_calibrated(CNN, (3, 8, 8))), (3, 8, 8)),
    "bounded": (lambda: lucid_fx.convert(_calibrated(Bounded, (8,))), (8,)),
    "qat": (_qat, (8,)),
    "prepared": (lambda: _calibrated(CNN, (3, 8, 8)), (3, 8, 8)),  # calibrated, not converted
    "prepared_bounded": (lambda: _calibrated(Bounded, (8,)), (8,)),
}


@functools.lru_cache(maxsize=None)
def _saved(kind: str) -> bytes:
    buffer = io.BytesIO()
    lucid_fx.save(KINDS[kind][0](), buffer)
    return buffer.getvalue()


def raw(kind: str) -> dict:
    """A fresh copy of the data a real file of ``kind`` holds."""
    return torch.load(io.BytesIO(_saved(kind)), weights_only=True)


def write(data) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return buffer


def nodes(data: dict) -> list:
    return data["model"]["graph"]["nodes"]


def node_record(name, op, target, args=(), kwargs=()):
    """A graph node as the file writes it (args and kwargs already encoded)."""
    return {"name": name, "op": op, "target": target, "args": {"$": "tuple", "v": list(args)},
            "kwargs": {"$": "dict", "v": [list(kv) for kv in kwargs]}, "tensor_type": False, "meta": {}}


def child(data: dict, class_suffix: str) -> dict:
    return copy.deepcopy(next(c for _, c in data["model"]["children"] if c and c.get("class", "").endswith(class_suffix)))
