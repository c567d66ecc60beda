"""Target: the hardware as one frozen object, resolved from the CPU kind (forced or detected)."""

import dataclasses

import pytest
import torch

import lucid_fx
from lucid_fx.kernels import force_cpu_features, weight_quant_range
from lucid_fx.kernels.cpu_features import ENV_VAR, detected_cpu_features
from lucid_fx.kernels.target import Target, cpu_kind, resolve_target


@pytest.mark.parametrize("kind, grid, as_conv, amx", [
    ("avx2", (-64, 63), True, False), ("avx512_vnni", (-128, 127), False, False), ("amx", (-128, 127), False, True),
])
def test_each_cpu_kind_gets_its_grid_and_kernel_choices(kind, grid, as_conv, amx):
    with force_cpu_features(kind):
        target = resolve_target("cpu")
        assert weight_quant_range("cpu") == grid  # the public helper reads the same Target
    assert (target.cpu.name, target.weight_range, target.linear_as_conv) == (kind, grid, as_conv)
    assert target.amx_zero_point_check == (amx or detected_cpu_features().amx)  # a real AMX CPU runs its oneDNN
    assert target.split_int_mm == (kind == "avx2") and target.fold_zero_point
    assert target.linear_row == {"avx2": "native"}.get(kind, "int_mm")
    # AMX: the row engine takes the rows oneDNN runs on its VNNI kernels there, on a real AMX CPU whatever kind is forced
    assert target.row_limit == (4 if amx or detected_cpu_features().amx else None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.weight_range = (-128, 127)


def test_cuda_weights_use_the_full_grid_whatever_the_cpu():
    with force_cpu_features("avx2"):
        target = resolve_target("cuda")
        assert resolve_target(device="cuda").backend == "cuda" and weight_quant_range("cuda") == (-128, 127)
    assert (target.backend, target.device, target.weight_range, target.fold_zero_point) == ("cuda", "cuda", (-128, 127), False)


def test_an_unknown_backend_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="unknown backend 'tpu'; valid: cpu, cuda"):
        resolve_target("tpu")


def test_prepare_and_convert_carry_the_target_they_resolved(monkeypatch):
    # prepare_qat trains weights on the target's grid; convert lowers with the same Target.
    seen = []
    from lucid_fx.passes import lower_to_int8 as lowering

    real = lowering.lower_to_int8
    monkeypatch.setattr(lowering, "lower_to_int8", lambda gm, table, target: seen.append(target) or real(gm, table, target))
    import lucid_fx.pipeline as pipeline

    monkeypatch.setattr(pipeline, "lower_to_int8", lowering.lower_to_int8)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).train()
    with force_cpu_features("avx2"):
        qat = lucid_fx.prepare_qat(model, example_inputs=(torch.randn(2, 4),))
        fake = qat.lucid_fx_weight_observers["0"]
        assert (fake.quant_min, fake.quant_max) == (-64, 63)
        qat(torch.randn(2, 4))
        lucid_fx.convert(qat.eval())
    assert [t.weight_range for t in seen] == [(-64, 63)] and isinstance(seen[0], Target)


def _calls(name):
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = set()
    for path in [*root.joinpath("lucid_fx").rglob("*.py"), *root.joinpath("passes").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and name in (getattr(func, "id", None), getattr(func, "attr", None)):
                found.add(path.relative_to(root).as_posix())
    return found


def test_only_the_target_asks_the_cpu_what_it_is():
    # Kernels may check the real CPU before a call that would be wrong there (detected_cpu_features).
    assert _calls("cpu_features") == {"lucid_fx/kernels/target.py", "lucid_fx/kernels/cpu_features.py"}
    # linear_row.py: a row engine only where its values are this machine's oneDNN's; target.py and onednn_check.py:
    # the checks of oneDNN's AMX kernels, whatever kind is forced.
    assert _calls("detected_cpu_features") <= {"lucid_fx/kernels/cpu.py", "lucid_fx/kernels/int_mm.py",
                                               "lucid_fx/kernels/linear_row.py", "lucid_fx/kernels/cpu_features.py",
                                               "lucid_fx/kernels/target.py", "lucid_fx/kernels/onednn_check.py"}
    assert _calls("weight_quant_range") == set()  # kept for users; lucid_fx reads Target.weight_range


def test_the_kind_set_in_the_environment_is_read_on_every_call(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert cpu_kind() == detected_cpu_features().name == resolve_target("cpu").cpu.name
    monkeypatch.setenv(ENV_VAR, "avx2")  # set after import: os.environ's own store is read, not a copy
    assert cpu_kind() == resolve_target("cpu").cpu.name == "avx2"
    with force_cpu_features("avx512_vnni"):  # a forced kind comes before the variable
        assert cpu_kind() == resolve_target("cpu").cpu.name == "avx512_vnni"
    monkeypatch.setenv(ENV_VAR, "avx1024")
    with pytest.raises(ValueError, match="unknown CPU kind 'avx1024'; valid: avx2, avx512_vnni, amx"):
        cpu_kind()
    monkeypatch.delenv(ENV_VAR)
    assert cpu_kind() == detected_cpu_features().name
