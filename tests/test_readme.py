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


def test_demo_sample_has_every_line_the_demo_prints():
    from lucid_fx.demo import DemoConfig, DemoResult

    sample = re.search(r"One run \(`lucid-fx demo`.*?```\n(.*?)```", README, re.S).group(1).splitlines()
    # convert's report ends with its FLOPs line, as a converted model's does
    result = DemoResult(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, "e", "c\nint8 FLOPs: 100.0% of 1 kFLOP", {"train": 1.0}, ["n"],
                        Path("x.html"))
    printed = [line.split(":")[0] for line in "\n".join(result.lines(DemoConfig.full())).splitlines()]
    assert [line.split(":")[0] for line in sample] == printed
    assert printed[-1] == "time" and re.fullmatch(r"time: train [\d.]+s, quantize [\d.]+s, latency [\d.]+s, compare [\d.]+s, graph [\d.]+s", sample[-1])


def test_examples_list_is_complete():
    listed = set(re.findall(r"`(\w+\.py)`", README.split("Runnable scripts are in `examples/`")[1].split("##")[0]))
    assert listed == {p.name for p in (ROOT / "examples").glob("*.py")}
