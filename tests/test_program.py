"""Converted models run a program built for their input signature and CPU (lucid_fx/program.py).

The program must compute what the portable graph computes, on every CPU kind, and must never be
state: copies, ``.to()``, ``load_state_dict``, ``recompile`` and save/load drop it and build again.
"""

import collections
import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx import program as program_module
from lucid_fx.kernels import KernelInputError, force_cpu_features
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import pointwise_rows as pr
from lucid_fx.kernels import row_plan as rp
from lucid_fx.kernels.cpu_features import CPU_KINDS, detected_cpu_features
from lucid_fx.kernels.target import resolve_target
from lucid_fx.program import MAX_SIGNATURES, programs_of
from lucid_fx.rules import program_cpu
from models import MLP, EfficientNetLike, MobileNetV3Like, ResNetLike, SqueezeExcite, _init_bn
from _grid import onednn_exact
from _program import called, operands

ON_CONV = torch.ops.onednn.qconv2d_pointwise.default
ONEDNN = {torch.ops.onednn.qlinear_pointwise.default, torch.ops.onednn.qconv2d_pointwise.default,
          torch.ops.onednn.qconv2d_pointwise.binary}


def _mlp():
    torch.manual_seed(0)
    return MLP(width=64, layers=3).eval(), torch.randn(4, 64)


def _resnet():
    torch.manual_seed(0)
    return _init_bn(ResNetLike(num_classes=10, width=16)).eval(), torch.randn(1, 3, 64, 64)


def _mobilenet():
    torch.manual_seed(0)
    return _init_bn(MobileNetV3Like(num_classes=10)).eval(), torch.randn(1, 3, 32, 32)


def _efficientnet():
    torch.manual_seed(0)
    return _init_bn(EfficientNetLike(num_classes=10)).eval(), torch.randn(1, 3, 32, 32)


MODELS = {"mlp": _mlp, "resnet": _resnet, "mobilenet_v3": _mobilenet, "efficientnet": _efficientnet}


def _quantize(model, x):
    return lucid_fx.quantize(model, (x,), [x, torch.randn_like(x), 2 * torch.randn_like(x)])


def _program(q):
    (program,) = programs_of(q).values()
    assert program is not None
    return program


@pytest.mark.parametrize("name", sorted(MODELS))
def test_program_computes_the_portable_graphs_values(name):
    # On this CPU's kind here; tests/test_every_cpu_kind.py runs it again as on each other kind.
    model, x = MODELS[name]()
    q = _quantize(model, x)
    portable = q(x)  # a new signature: the portable graph runs and the program is built
    assert len(programs_of(q)) == 1
    program = _program(q)
    got = q(x)
    # Same codes: the rules take each decision the run-time kernels take, with the same helpers.
    assert torch.equal(got, portable), (got - portable).abs().max()
    calls = {called(n) for n in program.graph.nodes if n.op == "call_function"}
    if onednn_exact(resolve_target("cpu")):  # else (a VNNI kind forced on an AVX2 CPU) the exact fallback kernels
        assert calls & (ONEDNN | {lr.linear_row, rp.planned_rows, rp.planned_rows_add, pr.pointwise_rows}), \
            f"no oneDNN call (or row engine linear) in the program of {name}"
    assert not any(getattr(t, "_qualified_op_name", "").startswith("lucid_fx::") for t in calls), \
        "a program calls kernel functions, not the dispatcher's lucid_fx ops"


def test_program_keeps_the_portable_nodes_names_and_meta():
    model, x = _resnet()
    q = _quantize(model, x)
    q(x)
    program = _program(q)
    portable = {n.name: n for n in q.graph.nodes if n.op == "call_function"
                and str(getattr(n.target, "_qualified_op_name", "")).startswith("lucid_fx::")}
    by_name = {n.name: n for n in program.graph.nodes}
    assert portable and set(portable) <= set(by_name)
    for name, node in portable.items():
        assert by_name[name].meta.get("lucid_fx.source") == node.meta.get("lucid_fx.source")
    # The portable graph is untouched: what save, compare and the viewer read.
    assert all(n.target not in ONEDNN for n in q.graph.nodes)


def test_the_program_differs_by_cpu_kind_and_each_matches_the_portable_graph():
    model, x = _mlp()
    with force_cpu_features("avx2"):  # the narrowest weight grid, which every kind's kernels take exactly
        q = _quantize(model, x)
    outputs = {}
    for kind in sorted(CPU_KINDS):
        with force_cpu_features(kind):
            q(x)
            outputs[kind] = q(x)
    assert {k[0] for k in programs_of(q)} == set(CPU_KINDS)  # one program per kind: the key holds it
    assert all(torch.equal(out, outputs["avx512_vnni"]) for out in outputs.values())


def test_a_program_is_built_per_input_signature_up_to_the_limit():
    model, x = _mlp()
    q = _quantize(model, x)
    for batch in range(1, MAX_SIGNATURES + 1):
        xb = torch.randn(batch, 64)
        first, again = q(xb), q(xb)
        assert torch.equal(first, again)
    with pytest.warns(RuntimeWarning, match=rf"^lucid_fx: this model has met more than {MAX_SIGNATURES} input signatures"):
        q(torch.randn(MAX_SIGNATURES + 1, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        xb = torch.randn(MAX_SIGNATURES + 2, 64)
        assert torch.equal(q(xb), q(xb))
    assert len(programs_of(q)) == MAX_SIGNATURES
    assert {k[1][0][0] for k in programs_of(q)} == set(range(1, MAX_SIGNATURES + 1))  # (cpu kind, (shape, ...))


def test_copies_moves_and_state_loads_drop_programs_and_build_again():
    model, x = _mlp()
    q = _quantize(model, x)
    expected = q(x)
    q(x)
    assert len(programs_of(q)) == 1
    twin = copy.deepcopy(q)
    assert programs_of(twin) == {} and len(programs_of(q)) == 1
    assert torch.equal(twin(x), expected) and torch.equal(twin(x), expected) and len(programs_of(twin)) == 1
    q.to("cpu")
    assert programs_of(q) == {}
    q(x)
    q.load_state_dict(twin.state_dict())
    assert programs_of(q) == {}
    q(x)
    q.recompile()
    assert programs_of(q) == {}


def test_save_writes_no_program_and_load_runs_one():
    model, x = _mlp()
    q = _quantize(model, x)
    expected = q(x)
    q(x)
    buffer = io.BytesIO()
    lucid_fx.save(q, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    assert programs_of(loaded) == {}
    assert torch.equal(loaded(x), expected) and torch.equal(loaded(x), expected)
    assert _program(loaded) is not None


def test_a_weight_edited_after_convert_reaches_the_program_after_recompile():
    model, x = _mlp()
    q = _quantize(model, x)
    q(x)
    before = q(x)
    weight = next(v for k, v in q.state_dict().items() if k.endswith("qweight"))
    weight.copy_(weight.flip(0))  # other rows, the same grid
    if onednn_exact(resolve_target("cpu")):  # the fallback kernels (a forced VNNI kind on AVX2) read the weight itself
        assert torch.equal(q(x), before), "a built program holds the packed weight (documented: recompile after an edit)"
    q.recompile()
    after_portable, after_program = q(x), q(x)
    assert torch.equal(after_portable, after_program) and not torch.equal(after_program, before)


class _Keyword(nn.Module):
    """A forward called with keywords and a default, as transformers models are."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x, mask=None):
        y = self.fc(x)
        return y if mask is None else y + mask


def test_keyword_calls_run_the_program_of_the_positional_call():
    torch.manual_seed(0)
    model, x, mask = _Keyword().eval(), torch.randn(4, 64), torch.randn(4, 64)
    q = lucid_fx.quantize(model, (x, mask), [(x, mask), (2 * x, mask)])
    portable = q(x, mask)
    assert torch.equal(q(x=x, mask=mask), portable) and torch.equal(q(x, mask=mask), portable)
    assert len(programs_of(q)) == 1, "keywords bind to the same signature as the positional call"
    assert torch.equal(q(mask=mask, x=x), portable) and len(programs_of(q)) == 1
    with pytest.raises(TypeError, match="masks"):
        q(x=x, masks=mask)  # a keyword the forward does not take: Python's own message
    assert len(programs_of(q)) == 1


def test_keywords_bind_to_positions_with_defaults_filled_in():
    def forward(pixel_values, interpolate_pos_encoding=None, return_dict=True):
        pass

    params = program_module._parameters(forward)
    assert program_module._bind(params, (1,), {"return_dict": False}) == (1, None, False)
    assert program_module._bind(params, (), {"pixel_values": 1}) == (1, None, True)
    assert program_module._bind(params, (1,), {"pixel_values": 2}) is None  # given twice: Python's error
    assert program_module._bind(params, (), {"return_dict": False}) is None  # pixel_values missing
    assert program_module._bind(params, (1, 2, 3, 4), {"x": 1}) is None
    assert program_module._parameters(lambda x, *rest: x) is None
    assert program_module._parameters(lambda x, **rest: x) is None


def test_hooks_run_the_portable_graph():
    model, x = _mlp()
    q = _quantize(model, x)
    seen = []
    q.register_forward_hook(lambda module, args, out: seen.append(out))
    q(x)
    q(x)
    assert len(seen) == 2 and programs_of(q) == {}


def test_bad_input_on_a_new_signature_gets_the_kernels_plain_message():
    model, x = _resnet()
    q = _quantize(model, x)
    with pytest.raises(KernelInputError, match=r"the input has 4 channels and the layer takes 3") as info:
        q(torch.randn(1, 4, 64, 64))
    assert not getattr(info.value, "__notes__", None), "the recorder's 'While executing' notes leaked"
    assert programs_of(q) == {}
    q(x)
    assert len(programs_of(q)) == 1  # a failed call leaves the signature free


def test_non_finite_input_to_a_program_is_refused_naming_the_node():
    model, x = _mlp()
    q = _quantize(model, x)
    q(x)
    _program(q)
    bad = x.clone()
    bad[1, 3] = math.nan
    with pytest.raises(KernelInputError, match=r"NaN"):
        q(bad)


def test_a_program_that_cannot_be_built_warns_once_and_the_portable_graph_serves(monkeypatch):
    model, x = _mlp()
    q = _quantize(model, x)

    def broken(b, node):
        raise RuntimeError("planted")

    monkeypatch.setitem(program_cpu.PROGRAM_RULES_CPU, "linear", broken)
    with pytest.warns(RuntimeWarning, match=r"no program for this input signature \(RuntimeError: planted\)"):
        expected = q(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(q(x), expected)
    assert list(programs_of(q).values()) == [None]


def test_install_programs_is_idempotent_and_keeps_the_class_name():
    model, x = _mlp()
    q = _quantize(model, x)
    cls = type(q)
    assert program_module.install_programs(q) is q and type(q) is cls
    runner, portable_class = cls.__mro__[1:3]
    assert cls.__mro__[0] is cls and runner is program_module.ProgramRunner
    assert cls.__name__ == portable_class.__name__ == "QuantizedModule"  # printed as before


def test_pickle_and_torch_save_keep_the_model_running_programs():
    model, x = _mlp()
    q = _quantize(model, x)
    expected = q(x)
    q(x)
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, program_module.ProgramRunner) and programs_of(loaded) == {}
    assert torch.equal(loaded(x), expected) and torch.equal(loaded(x), expected)
    assert len(programs_of(loaded)) == 1


class _ClassToken(nn.Module):
    """A linear reading a slice (h[:, 0]): its codes are not dense rows."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x))[:, 0])


def test_a_linear_on_a_slice_computes_the_portable_values_on_every_route():
    # Regression: the 1x1-convolution route (CPUs without VNNI) read a slice's codes as dense rows.
    torch.manual_seed(0)
    model, x = _ClassToken().eval(), torch.randn(8, 10, 16)
    with force_cpu_features("avx2"):
        q = _quantize(model, x)
    for kind in sorted(CPU_KINDS):
        with force_cpu_features(kind):
            portable, program = q(x), q(x)
            assert torch.equal(program, portable), kind
    assert len(programs_of(q)) == len(CPU_KINDS)


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64)])
def test_a_batch_one_linear_runs_off_onednn_where_that_was_measured_faster(shape, sqnr_db):
    # One row: lr.linear_row on the engine of the kind (Target.linear_row: _int_mm with VNNI, the
    # native GEMM without), where this machine's oneDNN gives its values; oneDNN elsewhere.
    torch.manual_seed(0)
    model, x = MLP(width=64, layers=3).eval(), torch.randn(shape)
    with force_cpu_features("avx2"):  # weights every kind's kernels take exactly
        q = _quantize(model, x)
    for kind in sorted(CPU_KINDS):
        with force_cpu_features(kind):
            portable, got = q(x), q(x)
            assert torch.equal(got, portable), kind  # the run-time kernel takes the same route
            assert sqnr_db(model(x), got) >= 30, kind
            program = next(p for key, p in programs_of(q).items() if key[0] == kind)
            calls = [called(n) for n in program.graph.nodes if n.op == "call_function"]
            row = lr.row_engine(resolve_target("cpu"), 1) is not None  # verified bit-identical to oneDNN here
            # a kind whose engine (VNNI's or AVX2's) is this CPU's oneDNN's: with VNNI (AMX too: a row asks oneDNN's
            # steps), the VNNI and AMX kinds; without, the AVX2 kind
            here = lr.engine_here() is not None or lr.few_rows_engine_here() is not None
            assert row == (here and CPU_KINDS[kind].vnni == detected_cpu_features().vnni), kind
            assert calls.count(rp.planned_rows) == (3 if row else 0), kind  # planned with the program (row_plan.py)
            assert len(set(calls) & ONEDNN) == (0 if row else 1), kind


@pytest.mark.parametrize("name", ["mobilenet_v3", "efficientnet"])
def test_squeeze_excite_convolutions_of_one_image_run_as_one_row_linears(name):
    # A 1x1 convolution of a 1x1 image is a linear of one row (lucid_fx/kernels/linear_row.py).
    model, x = MODELS[name]()
    for kind in ("avx512_vnni", "avx2"):  # the kinds with a row engine
        with force_cpu_features(kind):
            q = _quantize(model, x)  # weights on the kind's grid
            portable, got = q(x), q(x)
            program = next(p for key, p in programs_of(q).items() if key[0] == kind)
            target = resolve_target("cpu")
            engine = lr.row_engine(target)  # convolutions: an AMX CPU keeps them on oneDNN (Target.row_limit)
        assert torch.equal(got, portable), kind

        calls = [n for n in program.graph.nodes if n.op == "call_function"]
        # oneDNN calls left: none that is a row (a 1x1 image, unpadded, ungrouped) with a post-op linear_row folds
        conv_calls = [operands(n) for n in calls if called(n) == torch.ops.onednn.qconv2d_pointwise.default]
        rows_left = [args for args in conv_calls
                     if "val" in args[0].meta  # not a linear's (1, K, 1, M) view (Target.linear_as_conv)
                     and tuple(args[0].meta["val"].shape[2:]) == (1, 1) and args[0].meta["val"].shape[0] == 1
                     and not any(args[8]) and args[10] == 1 and args[-3] in lr.ROW_POST_OPS]
        se = sum(isinstance(m, SqueezeExcite) for m in model.modules())
        rows = sum(n.target is pr.pointwise_rows for n in calls)
        if engine is not None:
            assert not rows_left and rows >= se >= 2, kind  # every gate has a convolution without a fused SiLU
        elif target.row_limit is not None and target.linear_row == lr.few_rows_engine_here():  # AMX: oneDNN asked
            assert rows + len(rows_left) >= se and rows >= 1, kind  # (rules/program_cpu.py: _amx_conv_engine)
        elif onednn_exact(target):
            assert rows == 0 and len(rows_left) >= se, kind
        else:  # a VNNI kind forced on an AVX2 CPU: the exact fallback kernels, neither oneDNN nor a row engine
            assert rows == 0 and not rows_left, kind


def test_reference_mode_runs_as_written_after_convert_and_after_load():
    model, x = _mlp()
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    prepared(x)
    simulated = lucid_fx.convert(prepared, reference=True)
    assert not isinstance(simulated, program_module.ProgramRunner)
    assert not program_module.runs_int8_kernels(simulated)
    buffer = io.BytesIO()
    lucid_fx.save(simulated, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    assert not isinstance(loaded, program_module.ProgramRunner) and torch.equal(loaded(x), simulated(x))
    assert program_module.runs_int8_kernels(_quantize(model, x))


class Patches(nn.Module):
    """ViT's patch embedding: a convolution whose kernel tiles the image (stride = kernel, unpadded)."""

    def __init__(self, relu=False):
        super().__init__()
        self.proj, self.relu = nn.Conv2d(3, 16, 4, stride=4), relu

    def forward(self, x):
        y = self.proj(x)
        return (y.relu() if self.relu else y).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("relu", [False, True])
def test_a_patchify_convolution_runs_as_a_small_linear_of_its_patches_with_the_same_codes(relu):
    torch.manual_seed(0)
    model, x = Patches(relu).eval(), torch.randn(2, 3, 16, 16)
    q = _quantize(model, x)
    portable = q(x)
    assert torch.equal(q(x), portable)
    calls = {called(n) for n in _program(q).graph.nodes if n.op == "call_function"}
    takes_row = lr.takes_row(resolve_target("cpu"), True, "relu" if relu else "none", torch.uint8, 32, 16, 48) is not None
    assert (lr.linear_row in calls) == takes_row
    assert (ON_CONV in calls) == (not takes_row and onednn_exact(resolve_target("cpu")))  # else the exact fallback


def test_a_convolution_whose_kernel_does_not_tile_the_image_stays_on_onednn():
    torch.manual_seed(0)
    model, x = Patches().eval(), torch.randn(2, 3, 18, 18)  # 18 is not a multiple of 4
    q = _quantize(model, x)
    portable = q(x)
    assert torch.equal(q(x), portable)
    calls = {called(n) for n in _program(q).graph.nodes if n.op == "call_function"}
    assert (ON_CONV in calls) == onednn_exact(resolve_target("cpu")) and lr.linear_row not in calls


@pytest.mark.parametrize("family", ["llama", "vit"])
def test_attention_families_programs_compute_the_portable_values_through_the_native_routes(family):
    # Llama's rotary embedding (rotate_half's cat of a negated half), its additive causal mask, grouped
    # query attention's expanded keys, ViT's plain softmax: each on the program's own route.
    from lucid_fx.kernels import matmul_native, native, native_elementwise, native_rotary
    from lucid_fx.kernels import softmax_matmul as attention_rows
    from tests.models.families import FAMILIES, as_batch
    from tests.models.measure import positional

    spec = FAMILIES[family]
    torch.manual_seed(0)
    model, (args, kwargs) = spec.make_model(), spec.example_inputs()
    q = lucid_fx.quantize(model, positional(model, (args, kwargs)), [as_batch(b) for b in spec.calibration_batches(4)])
    with torch.no_grad():
        portable, got = q(*args, **kwargs), q(*args, **kwargs)
    for a, b in zip(torch.utils._pytree.tree_leaves(portable), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)
    calls = collections.Counter(called(n) for n in _program(q).graph.nodes if n.op == "call_function")
    # q @ k^T in each of two layers; softmax(s) @ v is one call (its softmax fused, masked or not)
    assert calls[matmul_native.matmul_codes] == (2 if native.available() else 0)
    assert calls[attention_rows.cpu_softmax_matmul] == 2
    if family == "llama":
        masks = [n.args[3] for n in _program(q).graph.nodes if n.target is attention_rows.cpu_softmax_matmul]
        assert all(isinstance(m, torch.fx.Node) for m in masks)  # the additive causal mask, read in float
        fused = native.available() and native_elementwise.fused_add()
        # q * cos + rotate_half(q) * sin, and k's, in both layers: one call each where torch's add is fused
        assert calls[native_rotary.rotary_codes] == (4 if fused else 0)
        assert calls[native_elementwise.add_codes] == 0
        # else each rotate_half: two lookups (-x2 and its requantization composed in one table; x1's requantization)
        assert sum(n for t, n in calls.items() if getattr(t, "__name__", "") == "lut") == (0 if fused else 8)


def test_extra_positional_inputs_are_refused_as_the_float_model_refuses_them():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    qmodel = lucid_fx.quantize(nn.Sequential(nn.Linear(8, 8)).eval(), (x,), [x], progress=False)
    # The first call of a signature recorded its values through an interpreter that ignored extra inputs, and the
    # program then took them too: q(x, y) was q(x).
    for args in ((x, x), (x, x, x)):
        with pytest.raises(TypeError, match=rf"^forward\(\) takes 2 positional arguments but {len(args) + 1} were given$"):
            qmodel(*args)
    assert torch.equal(qmodel(x), qmodel(x))


_COMPILED = """
import torch, lucid_fx
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                  nn.Linear(8, 4)).eval()
x = torch.randn(2, 3, 16, 16)
q = lucid_fx.quantize(m, (x,), [x, torch.randn_like(x)], progress=False)
compiled = torch.compile(q, backend="eager")
print(torch.equal(compiled(x), q(x)), torch.equal(compiled(x), q(x)))
"""


def test_torch_compile_of_a_converted_model_runs_it_eagerly():
    import subprocess
    import sys

    # In a process of its own: dynamo traced into the programs' ctypes calls on fake tensors, a segmentation fault.
    done = subprocess.run([sys.executable, "-c", _COMPILED], capture_output=True, text=True, timeout=600)
    assert (done.returncode, done.stdout) == (0, "True True\n"), done.stderr[-2000:]
    assert "lru_cache" not in done.stderr  # dynamo no longer traces lucid_fx's kernels' Python


def test_a_converted_model_pickled_then_deep_copied_runs():
    import pickle

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    qmodel = lucid_fx.quantize(model, (x,), [x], progress=False)
    expected = qmodel(x)
    buffer = io.BytesIO()
    torch.save(qmodel, buffer)  # pickling recompiles: fx's call wrapper went onto the model's class
    copied = copy.deepcopy(qmodel)  # whose own class then called the wrapper back: RecursionError
    loaded = pickle.loads(pickle.dumps(qmodel))
    assert torch.equal(copied(x), expected) and torch.equal(loaded(x), expected) and torch.equal(qmodel(x), expected)
    assert copy.deepcopy(copied)(x).equal(expected)


def test_importing_lucid_fx_leaves_torch_dynamo_unimported():
    import subprocess
    import sys

    # torch.compiler.disable at import imported torch._dynamo: a second of `import lucid_fx` (0.5 s without it).
    code = "import sys, lucid_fx; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr[-2000:]


def test_a_calls_key_holds_the_cpu_kind_and_each_inputs_layout_and_refuses_what_no_program_runs():
    x, flag = torch.randn(2, 3), 4
    key = program_module._signature((x, flag, None))
    assert key == (resolve_target("cpu").cpu.name, (x.shape, x.stride(), x.dtype), 4, None)
    with force_cpu_features("avx2"):
        assert program_module._signature((x,))[0] == "avx2"  # a forced kind: programs of its own
    assert program_module._signature((x.t(),)) != program_module._signature((x,))  # strides are part of it
    assert program_module._signature((torch.randn(2, 3, requires_grad=True),)) is None  # autograd: portable graph
    assert program_module._signature((torch.empty(2, 3, device="meta"),)) is None  # neither CPU nor CUDA
    assert program_module._signature((x, [1, 2])) is None  # a list: no program key


def test_the_call_in_cpp_runs_a_known_signature_itself_and_hands_the_python_call_the_rest(bound_ops_on, monkeypatch):
    monkeypatch.delenv("LUCID_FX_CPU_ISA", raising=False)  # a kind set in the environment: every call is handed over
    monkeypatch.setattr(program_module, "_NATIVE_CALL", [True])  # the call below stays in place
    runner, python, handed = program_module.ProgramRunner, program_module.ProgramRunner._python_call, []

    def spy(self, *args, **kwargs):  # the Python call, counted
        handed.append(sorted(kwargs) or len(args))
        return python(self, *args, **kwargs)

    forced, variable, kind = program_module.kind_inputs()
    monkeypatch.setattr(runner, "__call__", bound_ops_on.module().runner_method(runner, spy, forced, variable, kind,
                                                                                program_module._PROGRAMS))
    model, x = _mlp()
    q = _quantize(model, x)
    with torch.no_grad():
        portable = q(x)  # no program yet: the Python call records and builds it
        assert handed == [1]
        first, again = q(x), q(x)  # the program (planning its calls, then planned), run from C++
        assert handed == [1] and torch.equal(first, portable) and torch.equal(again, portable)
        assert torch.equal(q(x=x), portable) and handed[-1] == ["x"]  # keywords: bound by the Python call
        wide = torch.randn(3, 64)
        assert torch.equal(q(wide), python(q, wide)) and len(programs_of(q)) == 2 and len(handed) == 3
        q(wide)
        assert len(handed) == 3  # its program now: from C++
        other = "avx2" if program_module.cpu_kind() != "avx2" else "avx512_vnni"
        with force_cpu_features(other):  # a forced kind: the Python call, a program of its own
            assert torch.equal(q(x), python(q, x)) and len(handed) == 4
        assert len(programs_of(q)) == 3
        assert torch.equal(q(x.clone().requires_grad_()), portable) and len(handed) == 5  # autograd: portable graph
    seen = []
    handle = q.register_forward_hook(lambda m, args, out: seen.append(1))
    try:
        q(x)
    finally:
        handle.remove()
    assert seen == [1] and len(handed) == 6, "a hook: the Python call runs the portable graph and its hooks"
    with pytest.raises(TypeError):
        q(x, x)  # Python's own message for an extra input (no program for two inputs: handed over)
    assert len(handed) == 7


def test_a_built_program_puts_the_call_in_cpp(bound_ops_on, monkeypatch):
    monkeypatch.setattr(program_module.ProgramRunner, "__call__", program_module.ProgramRunner._python_call)
    monkeypatch.setattr(program_module, "_NATIVE_CALL", [])
    model, x = _mlp()
    q = _quantize(model, x)
    q(x)
    assert type(program_module.ProgramRunner.__dict__["__call__"]).__name__ == "instancemethod"  # runner_method's
    assert program_module._NATIVE_CALL == [True]


def test_without_bound_calls_the_call_stays_in_python(monkeypatch):
    monkeypatch.setattr(program_module.ProgramRunner, "__call__", program_module.ProgramRunner._python_call)
    monkeypatch.setattr(program_module, "_NATIVE_CALL", [])
    monkeypatch.setattr(program_module.bound_ops, "module", lambda: None)
    model, x = _mlp()
    q = _quantize(model, x)
    q(x)
    assert program_module.ProgramRunner.__dict__["__call__"] is program_module.ProgramRunner._python_call
    assert program_module._NATIVE_CALL == [True]  # tried once
