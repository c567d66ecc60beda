"""The install layout: passes/ is lucid_fx.passes, there is no top-level `passes`, imports are quiet."""

import subprocess
import sys


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    # Run from an empty folder so only the installed package (not the checkout) is importable.
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_passes_installs_inside_lucid_fx_only(tmp_path):
    proc = _run(
        "import importlib.util, pathlib, lucid_fx.passes as p\n"
        "print(pathlib.Path(p.__file__).parent.name)\n"
        "print(importlib.util.find_spec('passes'))\n",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    folder, top_level = proc.stdout.split()
    assert folder == "passes"
    assert top_level == "None"


def test_import_is_silent_and_leaves_cuda_alone(tmp_path):
    proc = _run(
        "import torch, lucid_fx, lucid_fx.quantization\n"
        "print(torch.cuda.is_initialized())\n",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert proc.stderr == ""


def test_public_names_resolve():
    import lucid_fx
    import lucid_fx.quantization as Q

    for module in (lucid_fx, Q):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == []
    assert len(Q.__all__) == len(set(Q.__all__))


def test_every_package_folder_is_declared_in_pyproject():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"lucid_fx.passes"} | {
        ".".join(p.parent.relative_to(root).parts) for p in (root / "lucid_fx").rglob("__init__.py")
    }
    assert found == declared


def test_no_benchmark_script_shadows_an_installed_package():
    # tests/conftest.py puts benchmarks/ first on sys.path: a script named like a package shadows it for every
    # importer (benchmarks/kernels.py hid Hugging Face's `kernels`, which transformers 5.25 imports at load)
    import importlib.metadata
    from pathlib import Path

    scripts = {p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")}
    assert "int8_kernels" in scripts and not scripts & set(importlib.metadata.packages_distributions())
