"""fuse_modules: the reference framework's eager-mode fusion, by module names.

Each group of names becomes one module, put where the first name was; the other names are left
as ``nn.Identity`` so the parent's ``forward`` runs unchanged. Batch norm is folded into the
conv's weight and bias with its running statistics (an eval-mode fold). lucid_fx's own
``prepare`` finds these patterns by itself; ``fuse_modules`` is for code written against the
reference framework, and for eager models that are never traced.
"""

from __future__ import annotations

import copy
from typing import List, Sequence, Tuple, Union

from torch import nn

from lucid_fx.quantization.fold_bn import fold_bn_into

__all__ = ["fuse_modules", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "LinearReLU"]


class ConvReLU1d(nn.Sequential):
    """``relu(conv1d(x))`` as one module: ``[0]`` the conv (batch norm folded in), ``[1]`` the ReLU."""


class ConvReLU2d(nn.Sequential):
    """``relu(conv2d(x))`` as one module: ``[0]`` the conv (batch norm folded in), ``[1]`` the ReLU."""


class ConvReLU3d(nn.Sequential):
    """``relu(conv3d(x))`` as one module: ``[0]`` the conv (batch norm folded in), ``[1]`` the ReLU."""


class LinearReLU(nn.Sequential):
    """``relu(linear(x))`` as one module: ``[0]`` the linear, ``[1]`` the ReLU."""


_CONVS = {nn.Conv1d: (nn.BatchNorm1d, ConvReLU1d), nn.Conv2d: (nn.BatchNorm2d, ConvReLU2d), nn.Conv3d: (nn.BatchNorm3d, ConvReLU3d)}
SUPPORTED = "Conv{1,2,3}d + BatchNorm{1,2,3}d, Conv + BatchNorm + ReLU, Conv + ReLU, Linear + ReLU"


def _describe(names: Sequence[str], modules: Sequence[nn.Module]) -> str:
    return ", ".join(f"{name!r} ({type(m).__name__})" for name, m in zip(names, modules))


def _fold(conv: nn.Module, bn: nn.Module, where: str) -> nn.Module:
    if bn.training:
        raise ValueError(
            f"fuse_modules: batch norm of {where} is in training mode; folding uses its running statistics, "
            "so call model.eval() first (quantization-aware training keeps conv and batch norm apart: lucid_fx.prepare_qat)"
        )
    if bn.running_mean is None or bn.num_features != conv.out_channels:
        raise ValueError(
            f"fuse_modules: cannot fold {where}: the batch norm must track running statistics and have "
            f"num_features == the conv's out_channels ({conv.out_channels})"
        )
    return fold_bn_into(conv, bn)


def _fused(names: Sequence[str], modules: List[nn.Module]) -> nn.Module:
    """The one module that replaces ``modules``, or ValueError for a list that is no pattern."""
    types = tuple(type(m) for m in modules)
    where = _describe(names, modules)
    conv_kind = _CONVS.get(types[0])
    if conv_kind is not None:
        bn_type, with_relu = conv_kind
        if types == (types[0], bn_type):  # bn(conv(x)) -> conv with folded weights
            return _fold(modules[0], modules[1], where)
        if types == (types[0], bn_type, nn.ReLU):  # relu(bn(conv(x))) -> ConvReLU(folded conv, relu)
            return with_relu(_fold(modules[0], modules[1], where), modules[2])
        if types == (types[0], nn.ReLU):  # relu(conv(x)) -> ConvReLU
            return with_relu(modules[0], modules[1])
    if types == (nn.Linear, nn.ReLU):  # relu(linear(x)) -> LinearReLU
        return LinearReLU(modules[0], modules[1])
    raise ValueError(f"fuse_modules: cannot fuse {where}; supported sequences: {SUPPORTED}")


def _groups(modules_to_fuse) -> List[Tuple[str, ...]]:
    if isinstance(modules_to_fuse, str) or not isinstance(modules_to_fuse, (list, tuple)):
        raise ValueError(f"fuse_modules: modules_to_fuse must be a list of module names or a list of such lists, got {modules_to_fuse!r}")
    if all(isinstance(name, str) for name in modules_to_fuse):
        modules_to_fuse = [modules_to_fuse]
    groups = []
    for group in modules_to_fuse:
        if not isinstance(group, (list, tuple)) or not all(isinstance(n, str) for n in group) or len(group) < 2:
            raise ValueError(f"fuse_modules: each group must list two or more module names, got {group!r}")
        groups.append(tuple(group))
    return groups


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def fuse_modules(model: nn.Module, modules_to_fuse: Union[Sequence[str], Sequence[Sequence[str]]], inplace: bool = False) -> nn.Module:
    """Fuse groups of modules, named by their qualified names, into single modules.

    Supported groups (in this order): ``Conv + BatchNorm`` -> the conv with the batch norm folded
    into its weight and bias; ``Conv + BatchNorm + ReLU`` -> ``ConvReLU{1,2,3}d(folded conv, relu)``;
    ``Conv + ReLU`` -> ``ConvReLU{1,2,3}d``; ``Linear + ReLU`` -> ``LinearReLU``. The fused module
    takes the first name's place and the others become ``nn.Identity``. Forward pre-hooks of the
    first module and forward hooks of the last move to the fused module.

    Args:
        model: the model; batch norms to fold must be in eval mode.
        modules_to_fuse: one list of names (``["conv", "bn", "relu"]``) or a list of such lists.
        inplace: fuse in ``model`` itself instead of a copy.

    Returns:
        The fused model. Raises ValueError for a group that is not a supported pattern, naming
        its modules and their types, and for a name that is not a submodule.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import lucid_fx.quantization as Q
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
        >>> fused = Q.fuse_modules(model, ["0", "1", "2"])
        >>> [type(m).__name__ for m in fused]
        ['ConvReLU2d', 'Identity', 'Identity']
        >>> x = torch.randn(1, 3, 8, 8)
        >>> torch.allclose(fused(x), model(x), atol=1e-6)
        True
    """
    groups = _groups(modules_to_fuse)
    work = model if inplace else copy.deepcopy(model)
    for names in groups:
        modules = []
        for name in names:
            try:
                modules.append(work.get_submodule(name))
            except AttributeError:
                raise ValueError(f"fuse_modules: {type(model).__name__} has no submodule {name!r} (in group {list(names)})") from None
        first, last = modules[0], modules[-1]
        pre = [(h, k in first._forward_pre_hooks_with_kwargs) for k, h in first._forward_pre_hooks.items()]
        post = [
            (h, k in last._forward_hooks_with_kwargs, k in last._forward_hooks_always_called)
            for k, h in last._forward_hooks.items()
        ]
        fused = _fused(names, modules)
        fused.train(modules[0].training)  # a new container starts in training mode; keep the model's
        # The hooks move rather than run twice (a folded conv is a copy and kept its own).
        for inner in (modules[0], fused[0] if isinstance(fused, nn.Sequential) else fused):
            inner._forward_pre_hooks.clear()
        modules[-1]._forward_hooks.clear()
        for hook, with_kwargs in pre:
            fused.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        for hook, with_kwargs, always_call in post:
            fused.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call)
        _set(work, names[0], fused)
        for name in names[1:]:
            identity = nn.Identity()
            identity.train(modules[0].training)
            _set(work, name, identity)
    return work
