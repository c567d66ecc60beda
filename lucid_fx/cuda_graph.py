"""A converted model's calls on CUDA inputs, replayed from one CUDA graph per input signature.

On a GPU a converted model of small layers is bound by launches, not by its int8 GEMMs: the batch-1
MLP of benchmarks/ launched 54 kernels a call, and ran at 0.11x fp32 eager on an H200 where the same
calls replayed from a CUDA graph captured around the model ran at 0.91x, and ResNet-like at 1.77x
against 0.23x (benchmarks/cuda_inference.py, before this module; docs/benchmarks.md). So
:mod:`lucid_fx.program` gives each CUDA input signature a :class:`CudaGraphProgram`: the
signature's first call runs the portable graph as always (its kernels check the input and name the
node), then the model is warmed up and captured; later calls copy their inputs into the captured
ones, replay, and return copies of the outputs (the next replay writes over the captured ones).

The replay computes what the portable graph computes, kernel for kernel. It is taken only where
autograd has nothing to record (no float parameter that requires grad, or grad disabled), and a
model whose forward cannot be captured (it reads a GPU value on the host: ``.item()``, a
data-dependent shape) keeps running the portable graph, with a warning saying why. Inside a
capture of the caller's, calls run the portable graph's kernels, which that capture records. Set
:data:`CUDA_GRAPHS` to False to run every CUDA call through the portable graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch
from torch.utils._pytree import tree_map

__all__ = ["CUDA_GRAPHS", "CudaGraphProgram", "capture", "replayable"]

#: Whether converted models replay CUDA calls from CUDA graphs (False: every call runs the portable graph).
CUDA_GRAPHS = True
_WARM_UP = 3  # calls on a side stream before capture (cuBLAS and the caching allocator set up there), as measured


class CudaGraphProgram:
    """One input signature's captured call: ``forward(*args)`` copies the tensors of ``args`` into
    the captured inputs, replays, and returns copies of the captured outputs."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", inputs: Tuple[Any, ...], outputs: Any) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def forward(self, *args: Any) -> Any:
        for static, value in zip(self.inputs, args):
            if isinstance(static, torch.Tensor):
                static.copy_(value)
        self.graph.replay()
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, self.outputs)


def replayable(model: torch.nn.Module) -> bool:
    """Whether a replay gives what a call would: autograd has nothing to record, and no capture of
    the caller's is under way (inside one, the model's kernels are recorded into the caller's graph)."""
    if not CUDA_GRAPHS or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    return not torch.is_grad_enabled() or not any(p.requires_grad for p in model.parameters())


def capture(model: torch.nn.Module, args: Tuple[Any, ...], call) -> Optional[CudaGraphProgram]:
    """``call(*args)`` (the portable graph) captured into a CUDA graph on copies of ``args``; None,
    with a warning, where it cannot be captured. The caller has run it once on ``args`` already."""
    with torch.inference_mode(False):  # plain tensors: a later call outside inference mode copies into them
        inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    device = next(a.device for a in inputs if isinstance(a, torch.Tensor))
    try:
        with torch.cuda.device(device), torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(_WARM_UP):
                    call(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = call(*inputs)
    except Exception as exc:  # noqa: BLE001 - the portable graph keeps serving this signature; say why
        _release_generator(device)
        warnings.warn(f"lucid_fx: this model's CUDA calls cannot be replayed from a CUDA graph ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); each call runs the portable graph's kernels one launch at a time "
                      "(correct, slower on small layers)", RuntimeWarning, stacklevel=4)
        return None
    return CudaGraphProgram(graph, inputs, outputs)


def _release_generator(device: torch.device) -> None:
    """After a failed capture, give the device's default generator a fresh state with the same seed and
    offset: the failed capture never ended the state's capture, and every later random op on the device
    would raise "Offset increment outside graph capture encountered unexpectedly" (torch 2.11, H200)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    fresh = torch.Generator(device=generator.device)
    fresh.set_state(generator.get_state())
    generator.graphsafe_set_state(fresh)
