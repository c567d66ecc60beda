"""Bound calls (kernels/native_bound.py): the generated entry points read the scalars a program fixed once, laid
out as ctypes lays them out, and compute what the plain entry points compute."""

import ctypes
import subprocess

import pytest
import torch

from lucid_fx.kernels import native, native_bound


def _kernels_with_scalars():
    return [k for k, (argtypes, _, _) in native.SIGNATURES.items() if native_bound.has_scalars(argtypes)]


def test_every_kernel_with_scalars_has_a_struct_and_a_bound_entry_per_dtype():
    text = native_bound.source(native.SIGNATURES, native.CODE_DTYPES)
    for kernel, (argtypes, restype, dtypes) in native.SIGNATURES.items():
        has = native_bound.has_scalars(argtypes)
        assert (f"struct lucid_{kernel}_scalars {{" in text) == has, kernel
        for dtype in dtypes:
            assert (f" lucid_{kernel}_{native.CODE_DTYPES[dtype]}_bound(" in text) == has, (kernel, dtype)
    assert "rotary" not in _kernels_with_scalars() and "gate_mul" in _kernels_with_scalars()  # pointers alone: none
    assert native.GENERATED == ((native_bound.NAME, text),)  # what the library is built with (and named by)


def test_the_generated_structs_are_laid_out_as_ctypes_lays_them_out(tmp_path):
    # Each field's offset and the size, as the C compiler lays the struct out, asserted at compile time.
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    checks = ["#include <stddef.h>"]
    for kernel in _kernels_with_scalars():
        layout = native_bound._struct(tuple(native.SIGNATURES[kernel][0]))
        checks.append(f"_Static_assert(sizeof(struct lucid_{kernel}_scalars) == {ctypes.sizeof(layout)}, \"{kernel}\");")
        for name, _ in layout._fields_:
            offset = getattr(layout, name).offset
            checks.append(f"_Static_assert(offsetof(struct lucid_{kernel}_scalars, {name}) == {offset}, \"{kernel}.{name}\");")
    source = tmp_path / "layout.c"
    source.write_text(native_bound.source(native.SIGNATURES, native.CODE_DTYPES) + "\n".join(checks) + "\n")
    done = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Werror", str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(checks) > 2 * len(_kernels_with_scalars())  # the sizes and at least one offset each


@pytest.mark.parametrize("build", ["this CPU", "portable"])
def test_a_bound_call_computes_what_the_plain_call_computes(native_build, build):
    native_build(build)
    torch.manual_seed(0)
    x = torch.randn(3, 77) * 4
    x[0, 0] = float("nan")  # the quantize pass's non-finite count: its result
    for dtype in (torch.uint8, torch.int8):
        scalars = (x.numel(), 1 / 0.05, 3, -7 if dtype == torch.int8 else 0, 100, 1)
        plain, bound = torch.empty(x.shape, dtype=dtype), torch.empty(x.shape, dtype=dtype)
        counted = native._function("quantize", dtype)(x.data_ptr(), plain.data_ptr(), *scalars)
        assert native.bind("quantize", dtype, *scalars)(x.data_ptr(), bound.data_ptr()) == counted == 1
        assert torch.equal(plain, bound)
        y = torch.randn(5, 33) * 9
        plain, bound = torch.empty(y.shape, dtype=dtype), torch.empty(y.shape, dtype=dtype)
        low = -2 if dtype == torch.int8 else 3
        scalars = (y.numel(), 0.37, 5, low, 90)  # requantize: n, mult, zp, low, high
        native._function("requantize", dtype)(y.data_ptr(), plain.data_ptr(), *scalars)
        native.bind("requantize", dtype, *scalars)(y.data_ptr(), bound.data_ptr())
        assert torch.equal(plain, bound) and int(plain.min()) == low  # the clamp read from the struct
    codes = torch.randint(0, 256, (4, 50), dtype=torch.uint8)  # dequantize: pointers, then n, zp, scale
    plain, bound = torch.empty(codes.shape), torch.empty(codes.shape)
    native._function("dequantize", torch.uint8)(codes.data_ptr(), plain.data_ptr(), codes.numel(), 17, 0.125)
    native.bind("dequantize", torch.uint8, codes.numel(), 17, 0.125)(codes.data_ptr(), bound.data_ptr())
    assert torch.equal(plain, bound) and torch.equal(plain, (codes.float() - 17) * 0.125)


def test_a_kernel_of_pointers_alone_binds_its_own_function(native_on):
    rotary = native.bind("rotary", torch.uint8)
    assert rotary.args == ("rotary", native._function("rotary", torch.uint8))  # no struct: nothing to fix


def test_without_the_native_kernels_bind_gives_none(monkeypatch):
    monkeypatch.setattr(native, "_library", lambda: (None, "off"))
    assert native.bind("gate_mul", torch.uint8, 1, 4, 8, 1, 3, 0, 0.01, 5, 0, 255) is None
