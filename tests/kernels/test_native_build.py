"""lucid_fx/kernels/native_build.py: the native library compiled once per machine and kept in a
private cache, named by what it was built from; a file another user could swap is never loaded."""

import os
import shutil
import stat
from pathlib import Path

import pytest

from lucid_fx.kernels import native, native_build

SOURCE = "int lucid_answer(void) { return ANSWER; }\n"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A cache directory of its own, a one-function C file, and a compiler that logs each call."""
    if shutil.which("cc") is None:
        if os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
            pytest.fail("LUCID_FX_REQUIRE_TOOLS=1 but there is no C compiler")
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    monkeypatch.setenv("LUCID_FX_CACHE_DIR", str(cache))
    monkeypatch.delenv("LUCID_FX_NATIVE_CACHE", raising=False)
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    log = tmp_path / "calls.log"
    cc = tmp_path / "logging-cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec cc "$@"\n')
    cc.chmod(0o700)
    return cache, source, log, str(cc)


def _calls(log: Path) -> list:
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line != "--version"]


def test_compiled_once_then_loaded_from_the_cache(setup):
    cache, source, log, cc = setup
    flags = [["-O1", "-DANSWER=42"]]
    with native_build.built(cc, flags, [source]) as (so, how):
        assert so.parent == cache and "(kept in " in how and how.startswith(f"compiled with {cc} -O1")
    assert len(_calls(log)) == 2  # the source, then the library
    with native_build.built(cc, flags, [source]) as (again, how):
        assert again == so and "(loaded from " in how
    assert len(_calls(log)) == 2  # no compiler call the second time
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and native_build.is_private(so)


def test_a_file_another_user_could_swap_is_not_loaded(setup):
    cache, source, log, cc = setup
    flags = [["-O1", "-DANSWER=42"]]
    with native_build.built(cc, flags, [source]) as (so, _):
        pass
    so.chmod(0o666)  # writable by anyone: compiled again, and the file replaced by a private one
    with native_build.built(cc, flags, [source]) as (again, how):
        assert again == so and "(kept in " in how
    assert len(_calls(log)) == 4 and native_build.is_private(so)
    cache.chmod(0o777)  # a directory anyone may write to: nothing is kept or loaded there
    try:
        assert native_build.cache_dir() is None
        with native_build.built(cc, flags, [source]) as (elsewhere, how):
            assert elsewhere.parent.parent != cache and how == f"compiled with {cc} -O1 -DANSWER=42"
    finally:
        cache.chmod(0o700)


def test_a_build_a_killed_process_left_is_dropped_at_the_next_build(setup):
    cache, source, _, cc = setup
    cache.mkdir(mode=0o700)
    abandoned, recent = cache / "lucid_fx_native_killed", cache / "lucid_fx_native_running"
    for d in (abandoned, recent):
        d.mkdir()
        (d / "native.o").write_bytes(b"half")
    os.utime(abandoned, (0, 0))  # an hour and more ago
    with native_build.built(cc, [["-O1", "-DANSWER=42"]], [source]) as (so, _):
        assert so.exists()
    assert not abandoned.exists() and recent.exists()  # another process may still be building there


def test_a_new_build_keeps_only_the_most_recently_used_libraries(setup, monkeypatch):
    cache, source, _, cc = setup
    monkeypatch.setattr(native_build, "KEEP", 3)
    built = []
    for answer in range(4):  # four builds, oldest first
        with native_build.built(cc, [["-O1", f"-DANSWER={answer}"]], [source]) as (so, _):
            built.append(so)
        os.utime(so, (1000.0 * (answer + 1),) * 2)  # built at distinct times
    assert [so.exists() for so in built] == [False, True, True, True]  # the fourth build removed the first
    with native_build.built(cc, [["-O1", "-DANSWER=1"]], [source]) as (so, how):
        assert so == built[1] and "(loaded from " in how  # a load makes it the most recent
    with native_build.built(cc, [["-O1", "-DANSWER=9"]], [source]) as (so, _):
        assert so.exists()
    assert [so.exists() for so in built] == [False, True, False, True]  # the least recently used went
    assert len(list(cache.glob("native-*.so"))) == 3


def test_the_name_is_what_the_library_was_built_from(setup, monkeypatch):
    _, source, _, cc = setup
    key = native_build.library_key(cc, ["-O1"], [source])
    assert native_build.library_key(cc, ["-O1"], [source]) == key
    assert native_build.library_key(cc, ["-O2"], [source]) != key  # the flags
    assert native_build.library_key("cc", ["-O1"], [source]) != key  # the compiler
    monkeypatch.setattr(native_build, "_machine", lambda: ["x86_64", "flags : avx2 avx512_vnni"])
    assert native_build.library_key(cc, ["-O1"], [source]) != key  # the CPU -march=native compiles for
    monkeypatch.undo()
    source.write_text(SOURCE.replace("ANSWER", "ANSWER + 1"))
    assert native_build.library_key(cc, ["-O1"], [source]) != key  # the source


def test_without_a_home_or_an_absolute_path_nothing_is_kept_in_the_working_directory(setup, monkeypatch, tmp_path):
    monkeypatch.delenv("LUCID_FX_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no home directory: "~" stays "~"
    monkeypatch.chdir(tmp_path)
    assert native_build.cache_dir() is None
    monkeypatch.setenv("LUCID_FX_CACHE_DIR", "relative/cache")
    assert native_build.cache_dir() is None and not (tmp_path / "relative").exists()


def test_turned_off_nothing_is_kept(setup, monkeypatch):
    cache, source, log, cc = setup
    monkeypatch.setenv("LUCID_FX_NATIVE_CACHE", "0")
    with native_build.built(cc, [["-O1", "-DANSWER=42"]], [source]) as (so, how):
        assert so.exists() and "kept" not in how
    assert not so.exists() and not cache.exists()  # compiled in a temporary directory, gone after loading


def test_a_compiler_error_falls_back_to_the_next_flags_and_then_says_why(setup):
    cache, source, log, cc = setup
    with native_build.built(cc, [["-O1"], ["-O1", "-DANSWER=7"]], [source]) as (so, how):
        assert "-DANSWER=7" in how  # ANSWER undefined under the first flags
    with native_build.built(cc, [["-O1"]], [source]) as (so, how):
        assert so is None and how.startswith(f"{cc} failed (") and how.endswith("the torch kernels run")
        assert "error:" in how and "ANSWER" in how  # the compiler's first error, not the caret line under it


def test_a_library_kept_for_later_flags_is_loaded_without_compiling_the_earlier_flags_again(setup):
    # (-fopenmp on a compiler without OpenMP: not a failed compile in every process)
    cache, source, log, cc = setup
    flags = [["-O1"], ["-O1", "-DANSWER=7"]]
    with native_build.built(cc, flags, [source]) as (so, how):
        assert "-DANSWER=7" in how and "(kept in " in how
    compiled = len(_calls(log))
    with native_build.built(cc, flags, [source]) as (again, how):
        assert again == so and "-DANSWER=7" in how and "(loaded from " in how
    assert len(_calls(log)) == compiled


def test_a_kept_library_that_does_not_load_is_dropped_and_said(setup, monkeypatch):
    cache, _, _, cc = setup
    monkeypatch.setenv("LUCID_FX_CC", "cc")
    monkeypatch.delenv("LUCID_FX_NATIVE", raising=False)
    key = native_build.library_key("cc", native_build.capped(native.FLAGS)[0], [*native.SOURCES, *native.HEADERS],
                                    native.GENERATED)
    broken = cache / f"native-{key}.so"
    cache.mkdir(mode=0o700)
    broken.write_bytes(b"\x7fELF cut short")
    functions, how = native._library.__wrapped__()
    assert functions is None and how.startswith(f"{broken} did not load (") and how.endswith("the torch kernels run")
    assert not broken.exists()  # the next process builds it again


@pytest.mark.parametrize("cap,machine,capped", [
    ("AVX2", "x86_64", True), ("avx2", "AMD64", True),  # oneDNN's AVX2 kernels: an AVX2 CPU's build
    ("", "x86_64", False), ("AVX512_CORE_VNNI", "x86_64", False), ("ALL", "x86_64", False),
    ("AVX2", "aarch64", False),  # no such cap there
])
def test_the_library_is_an_avx2_cpu_s_where_onednn_is_capped_at_avx2(monkeypatch, cap, machine, capped):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(native_build.platform, "machine", lambda: machine)
    first = (*native.FLAGS[0], "-mno-avx512f", "-mno-avxvnni") if capped else native.FLAGS[0]
    assert native_build.capped(native.FLAGS) == (first, *native.FLAGS[1:])


def test_onednn_s_older_variable_caps_the_library_too(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    assert native_build.capped(native.FLAGS)[0][-2:] == ("-mno-avx512f", "-mno-avxvnni")


def test_each_flag_set_is_tried_again_without_openmp_after_all_of_them():
    # a compiler without OpenMP builds the library whose GEMM runs on one thread, before none at all
    sets = (("-march=native", "-O3", "-fopenmp"), ("-O3", "-fopenmp"))
    assert native_build.with_fallbacks(sets) == (*sets, ("-march=native", "-O3"), ("-O3",))
    assert native_build.with_fallbacks((("-O3",),)) == (("-O3",),)


def test_the_compiler_is_the_first_variable_set_and_must_be_on_the_path(monkeypatch):
    monkeypatch.delenv("LUCID_FX_CC", raising=False)
    monkeypatch.setenv("CC", "sh -c")  # a program on every PATH, with its arguments
    assert native_build.compiler(("LUCID_FX_CC", "CC"), "cc") == "sh -c"
    monkeypatch.setenv("LUCID_FX_CC", "no-such-compiler-here")
    assert native_build.compiler(("LUCID_FX_CC", "CC"), "cc") is None  # named, not found: no fallback to CC
    monkeypatch.delenv("LUCID_FX_CC")
    monkeypatch.delenv("CC")
    assert native_build.compiler(("LUCID_FX_CC", "CC"), "sh") == "sh"
