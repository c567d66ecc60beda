"""The README's install, run as a new user would: a fresh virtual environment, the README's pip
command, then an import that turns every warning into an error and the CLI's help.

Without numpy declared, torch printed "Failed to initialize NumPy" on every command and
``python -W error -c "import lucid_fx"`` failed. Takes about a minute (torch's wheel is local).
"""

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _readme_install_command() -> list:
    block = re.search(r"## Run the main job.*?```bash\n(.*?)\n```", README, re.S).group(1)
    install = block.split("&&")[0].split()
    assert install[:4] == ["python", "-m", "pip", "install"], block
    return install[1:]


@pytest.mark.slow
def test_readme_install_in_a_fresh_venv_imports_and_runs_without_warnings(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONWARNINGS")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    install = subprocess.run([str(python), *_readme_install_command()], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]

    # From an empty folder, so only the installed package is importable.
    work = tmp_path / "work"
    work.mkdir()
    imported = subprocess.run([str(python), "-W", "error", "-c", "import lucid_fx, numpy; print(lucid_fx.__name__)"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert (imported.returncode, imported.stdout, imported.stderr) == (0, "lucid_fx\n", "")

    helped = subprocess.run([str(env_dir / "bin" / "lucid-fx"), "--help"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr
    assert helped.stdout.startswith("usage: lucid-fx")
    # The environment is really a fresh one: its own torch, not the one running this test.
    where = subprocess.run([str(python), "-c", "import torch, sys; print(sys.prefix); print(torch.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    prefix, torch_file = where.stdout.split()
    assert Path(prefix) == env_dir and torch_file.startswith(str(env_dir)) and Path(sys.prefix) != env_dir
