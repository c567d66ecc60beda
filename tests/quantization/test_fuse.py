"""fuse_modules against torch.ao.quantization.fuse_modules (oracle in tests only)."""

import warnings

import pytest
import torch
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.ao's eager API announces its migration on import
    from torch.ao.quantization import fuse_modules as ao_fuse_modules


def _randomise(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)


class Block(nn.Module):
    """Names in a nested module, and an unfused op after them (the parent's forward is unchanged)."""

    def __init__(self, conv, bn=None, relu=True):
        super().__init__()
        self.conv, self.bn, self.relu = conv, bn if bn is not None else nn.Identity(), nn.ReLU() if relu else nn.Identity()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x))) * 2


CASES = {
    "conv1d_bn": (lambda: Block(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5), relu=False), ["conv", "bn"], (2, 3, 9)),
    "conv2d_bn": (lambda: Block(nn.Conv2d(3, 5, 3, bias=False), nn.BatchNorm2d(5), relu=False), ["conv", "bn"], (2, 3, 8, 8)),
    "conv3d_bn": (lambda: Block(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4), relu=False), ["conv", "bn"], (1, 2, 5, 5, 5)),
    "conv2d_bn_relu": (lambda: Block(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)), ["conv", "bn", "relu"], (2, 3, 8, 8)),
    "conv1d_relu": (lambda: Block(nn.Conv1d(3, 5, 3)), ["conv", "relu"], (2, 3, 9)),
    "conv2d_relu": (lambda: Block(nn.Conv2d(3, 5, 3, stride=2, padding=1)), ["conv", "relu"], (2, 3, 8, 8)),
    "linear_relu": (lambda: Block(nn.Linear(6, 4)), ["conv", "relu"], (3, 6)),
}


def _structure(model):
    return [(name, type(m).__name__) for name, m in model.named_modules()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_ao(case):
    factory, names, shape = CASES[case]
    torch.manual_seed(0)
    model = factory()
    if isinstance(model.bn, nn.modules.batchnorm._BatchNorm):
        _randomise(model.bn)
    model.eval()
    before = _structure(model)
    ours, oracle = Q.fuse_modules(model, names), ao_fuse_modules(model, names)
    assert _structure(ours) == _structure(oracle)  # ConvReLU2d/LinearReLU/Conv*d in place, Identity for the rest
    assert [type(m).__name__ for m in (getattr(ours, n) for n in names[1:])] == ["Identity"] * (len(names) - 1)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), oracle(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(x), model(x), atol=1e-5, rtol=1e-5)
    assert _structure(model) == before  # the input model is untouched


def test_list_of_lists_nested_names_and_inplace():
    torch.manual_seed(1)
    model = nn.Sequential(Block(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.Flatten(), nn.Linear(144, 8), nn.ReLU())
    _randomise(model[0].bn)
    model.eval()
    groups = [["0.conv", "0.bn", "0.relu"], ["2", "3"]]
    expected = _structure(ao_fuse_modules(model, groups))
    x = torch.randn(2, 3, 8, 8)
    before = model(x)
    same = Q.fuse_modules(model, groups, inplace=True)
    assert same is model and _structure(model) == expected
    assert [type(model[0].conv).__name__, type(model[2]).__name__] == ["ConvReLU2d", "LinearReLU"]
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_hooks_move_to_the_fused_module_and_run_once():
    model = Block(nn.Conv2d(1, 2, 3)).eval()
    calls = []
    model.conv.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model.relu.register_forward_hook(lambda m, args, out: calls.append("post"))
    fused = Q.fuse_modules(model, ["conv", "relu"])
    fused(torch.randn(1, 1, 5, 5))
    assert calls == ["pre", "post"]


@pytest.mark.parametrize(
    "build, names, message",
    [
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.BatchNorm2d(2)), ["0", "1", "2"],
         r"cannot fuse '0' \(Conv2d\), '1' \(ReLU\), '2' \(BatchNorm2d\); supported sequences: Conv\{1,2,3\}d \+ BatchNorm"),
        (lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), ["0", "1"], r"cannot fuse '0' \(Linear\), '1' \(BatchNorm1d\)"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm1d(2)), ["0", "1"], r"cannot fuse '0' \(Conv2d\), '1' \(BatchNorm1d\)"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), ["0", "2"], r"Sequential has no submodule '2' \(in group \['0', '2'\]\)"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), ["0"], "each group must list two or more module names"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), "01", "must be a list of module names"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(3)), ["0", "1"], r"num_features == the conv's out_channels \(2\)"),
    ],
    ids=["order", "linear_bn", "bn_dims", "missing", "single", "string", "channels"],
)
def test_bad_lists_raise_value_error(build, names, message):
    with pytest.raises(ValueError, match=message):
        Q.fuse_modules(build().eval(), names)


def test_training_mode_batch_norm_is_refused():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))  # training mode
    with pytest.raises(ValueError, match=r"batch norm of '0' \(Conv2d\), '1' \(BatchNorm2d\) is in training mode; .*model.eval\(\)"):
        Q.fuse_modules(model, ["0", "1"])
    assert type(Q.fuse_modules(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["0", "1"])[0]).__name__ == "LinearReLU"


def test_fused_model_prepares_and_converts(sqnr_db):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 4))
    _randomise(model[1])
    model.eval()
    fused = Q.fuse_modules(model, ["0", "1", "2"])
    batches = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(fused, (batches[0],), batches)
    assert qmodel.lucid_fx_convert_report.lowered["_0_1"] == "conv2d+relu"  # ConvReLU2d traced into one kernel
    assert sqnr_db(model(batches[0]), qmodel(batches[0])) > 25


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fused_modules_keep_the_models_training_mode(mode):
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4), nn.ReLU())
    model.train(mode == "train")
    fused = Q.fuse_modules(model, [["0", "1"], ["3", "4"]])
    assert {m.training for m in fused.modules()} == {mode == "train"}
    if mode == "eval":  # prepare refuses training-mode models, so this used to fail after fusion
        lucid_fx.prepare(fused, example_inputs=(torch.randn(1, 2, 5),))


def test_keyword_hooks_keep_their_calling_convention():
    seen = []
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU()).eval()
    model[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre", sorted(kwargs))), with_kwargs=True)
    model[1].register_forward_hook(lambda m, args, kwargs, out: seen.append(("post", out.shape)), with_kwargs=True)
    fused = Q.fuse_modules(model, ["0", "1"])
    fused(torch.randn(2, 3))
    assert seen == [("pre", []), ("post", torch.Size([2, 3]))]
