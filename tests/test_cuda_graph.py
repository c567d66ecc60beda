"""lucid_fx/cuda_graph.py: CUDA calls of a converted model replay a captured CUDA graph. The
capture and replay need a GPU (cuda marker); which calls may replay is decided on the CPU too."""

import pytest
import torch
from torch import nn

import lucid_fx
import lucid_fx.cuda_graph as cuda_graph
from lucid_fx.cuda_graph import CudaGraphProgram, capture, replayable
from lucid_fx.program import _signature, programs_of


def on_gpu(test):
    """The cuda marker, and a skip without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture
def mlp_on_gpu():
    """A converted MLP on the GPU and an input for it."""
    return _quantized(_mlp()), torch.randn(8, 32, device="cuda")


class Kept(nn.Module):
    """A leaf the tracer keeps whole: it stays float, with a parameter that requires grad."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


class Syncs(nn.Module):
    """Reads a GPU value on the host, which a CUDA graph cannot capture."""

    def forward(self, x):
        return x * float(x.abs().amax())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


def _quantized(model, leaves=(), device="cuda"):
    model = model.to(device)
    batches = [torch.randn(8, model[0].in_features, device=device) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],), leaf_modules=leaves, backend=device)
    lucid_fx.calibrate(prepared, batches, progress=False)
    return lucid_fx.convert(prepared)


def test_a_signature_names_the_cuda_device_and_refuses_mixed_or_other_devices():
    cpu = torch.randn(2, 3)
    assert not any(isinstance(part, torch.device) for part in _signature((cpu,)))
    assert _signature((torch.empty(2, 3, device="meta"),)) is None
    assert _signature((cpu.requires_grad_(),)) is None


def test_a_call_may_replay_only_where_autograd_records_nothing():
    model = nn.Sequential(Kept(4)).eval()
    with torch.no_grad():
        assert replayable(model)
    assert not replayable(model)  # grad on, and a parameter that requires it
    model.requires_grad_(False)
    assert replayable(model)
    cuda_graph.CUDA_GRAPHS = False
    try:
        assert not replayable(model)
    finally:
        cuda_graph.CUDA_GRAPHS = True


class _Replays:
    """What a captured graph does when replayed: its outputs recomputed in place from its inputs."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self):
        for name, value in self.fn(*self.inputs).items():
            self.outputs[name].copy_(value)


def test_a_replay_copies_the_inputs_in_and_returns_copies_of_the_outputs():
    inputs, outputs = (torch.zeros(2, 3), 5), {"y": torch.zeros(2, 3), "steps": 7}
    tensors = {"y": outputs["y"]}
    program = CudaGraphProgram(_Replays(lambda x, n: {"y": x * n}, inputs, tensors), inputs, outputs)
    first = program.forward(torch.ones(2, 3), 5)
    second = program.forward(torch.full((2, 3), 3.0), 5)
    assert torch.equal(first["y"], torch.full((2, 3), 5.0)), "the next replay wrote over an earlier result"
    assert torch.equal(second["y"], torch.full((2, 3), 15.0)) and second["steps"] == 7
    assert first["y"].data_ptr() != outputs["y"].data_ptr()


def test_a_capture_that_fails_warns_and_leaves_the_portable_graph():
    with pytest.warns(RuntimeWarning, match="cannot be replayed from a CUDA graph .*runs the portable graph"):
        assert capture(nn.Identity(), (torch.zeros(2),), lambda x: x) is None  # (no CUDA device here, or a CPU tensor)


@on_gpu
def test_later_calls_replay_the_graph_and_give_the_portable_graphs_codes(mlp_on_gpu):
    qmodel, x = mlp_on_gpu
    other = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        first = qmodel(x)  # the portable graph, then the capture
        (program,) = programs_of(qmodel).values()
        assert isinstance(program, CudaGraphProgram)
        again, then = qmodel(x), qmodel(other)
        portable = nn.Module.__call__(qmodel, other)
    assert torch.equal(again, first), "a replay computes what the portable graph computed"
    assert torch.equal(then, portable)
    assert not torch.equal(again, then), "each call returns its own tensor: the next replay did not write over it"
    assert again.data_ptr() != program.outputs.data_ptr()


@on_gpu
def test_a_model_that_reads_the_gpu_on_the_host_warns_once_and_runs_the_portable_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Syncs(), nn.Linear(64, 16)).eval()
    qmodel = _quantized(model, leaves=(Syncs,))
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cannot be replayed from a CUDA graph"):
        first = qmodel(x)
    with torch.no_grad():
        assert list(programs_of(qmodel).values()) == [None]
        assert torch.equal(qmodel(x), first)
        assert torch.equal(qmodel(x * 2), nn.Module.__call__(qmodel, x * 2))
    assert torch.randn(3, device="cuda").shape == (3,), "random ops still run after the failed capture"


@on_gpu
def test_a_capture_invalidated_by_a_host_read_leaves_random_ops_working():
    def call(x):  # runs in the warm-up; inside the capture it reads the GPU on the host, which ends the capture
        y = torch.rand_like(x) + x
        return y.sum().item() if torch.cuda.is_current_stream_capturing() else y

    with pytest.warns(RuntimeWarning, match="cannot be replayed from a CUDA graph"):
        assert capture(nn.Identity(), (torch.zeros(4, device="cuda"),), call) is None
    torch.manual_seed(3)
    first = torch.rand(5, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(torch.rand(5, device="cuda"), first), "the generator's seed still rules"


@on_gpu
def test_with_grad_on_and_a_float_layer_that_trains_calls_run_the_portable_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Kept(64)).eval()  # the float layer last: its output records autograd
    qmodel = _quantized(model, leaves=(Kept,))
    x = torch.randn(8, 32, device="cuda")
    out = qmodel(x)
    assert out.requires_grad and programs_of(qmodel) == {}
    with torch.no_grad():
        qmodel(x)
    assert [type(p) for p in programs_of(qmodel).values()] == [CudaGraphProgram]


@on_gpu
def test_a_graph_captured_in_inference_mode_replays_outside_it(mlp_on_gpu):
    qmodel, x = mlp_on_gpu
    with torch.inference_mode():
        first = qmodel(x)
    with torch.no_grad():
        again = qmodel(x)
    with torch.inference_mode():
        third = qmodel(x)
    assert torch.equal(again, first) and torch.equal(third, first)


@on_gpu
def test_a_caller_may_capture_the_model_into_a_graph_of_its_own(mlp_on_gpu):
    qmodel, x = mlp_on_gpu
    with torch.no_grad():
        expected = qmodel(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            qmodel(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = qmodel(x)  # inside the caller's capture: the kernels, not the model's own replay
        graph.replay()
    assert torch.equal(captured, expected)
