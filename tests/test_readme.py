"""The README's Python blocks run verbatim, and its test command is the one .ci/run uses."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "FixedQParamsObserver" in out and "HistogramObserver" in out


def test_ci_runs_the_readme_test_command():
    command = re.search(r"## Run the tests.*?```bash\n(.*?)\n```", README, re.S).group(1).strip()
    assert command in (ROOT / ".ci" / "run").read_text()
