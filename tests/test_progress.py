"""Progress as tqdm behaves: a bar redrawn in place on a terminal, nothing in a log by default,
plain lines in a log when asked; the same default for calibrate, quantize, the CLI and the demo.

The CLI tests read what the real process writes to a pipe and to a pseudo-terminal."""

import dataclasses
import inspect
import io
import os
import pty
import re
import select
import subprocess
import sys

import pytest
import torch

import lucid_fx
from lucid_fx import _progress
from lucid_fx.demo import DemoConfig, DemoNet, make_patterns, train

FULL = re.compile(r"calibrate \[#{24}\] 3/3 [\d.]+ batch/s [\d.]+s")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _prepared():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    return lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))


def _batches():
    return [torch.randn(2, 4) for _ in range(3)]


def test_one_default_across_the_verbs():
    defaults = {
        name: inspect.signature(fn).parameters["progress"].default
        for name, fn in (("calibrate", lucid_fx.calibrate), ("quantize", lucid_fx.quantize), ("run_demo", lucid_fx.demo.run_demo))
    }
    assert defaults == {"calibrate": None, "quantize": None, "run_demo": None}


def test_a_log_gets_nothing_by_default_and_lines_when_asked(monkeypatch):
    log = io.StringIO()
    assert lucid_fx.calibrate(_prepared(), _batches(), stream=log) == 3
    assert log.getvalue() == ""
    monkeypatch.setattr(_progress, "LINE_EVERY_S", 0.0)  # a line per batch, as on a long run
    lucid_fx.calibrate(_prepared(), _batches(), progress=True, stream=log)
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue() and lines[-1] == ""
    assert [line.split(" [")[1].split("]")[0].count("#") for line in lines[:-1]] == [8, 16, 24, 24]
    assert FULL.fullmatch(lines[-2])


def test_a_terminal_gets_a_bar_redrawn_in_place(monkeypatch):
    monkeypatch.setattr(_progress, "REDRAW_EVERY_S", 0.0)
    tty = Terminal()
    lucid_fx.calibrate(_prepared(), _batches(), stream=tty)
    frames = tty.getvalue().split("\r\x1b[K")
    assert frames[0] == "" and len(frames) == 5  # three redraws and the last frame
    assert [f[-1] for f in frames[1:]] == ["\r", "\r", "\r", "\n"]
    assert FULL.fullmatch(frames[-1].rstrip("\n"))
    quiet = Terminal()
    lucid_fx.calibrate(_prepared(), _batches(), progress=False, stream=quiet)
    assert quiet.getvalue() == ""


def test_the_demo_reports_training_progress(monkeypatch):
    monkeypatch.setattr(_progress, "LINE_EVERY_S", 1e9)  # however slow the machine: only the last line
    config = dataclasses.replace(DemoConfig.quick(), epochs=2, batch_size=32)
    images, labels = make_patterns(96, seed=0)
    log = io.StringIO()
    train(DemoNet(), images, labels, config, seed=0, progress=True, stream=log)
    (line,) = log.getvalue().splitlines()
    assert re.fullmatch(r"train \[#{24}\] 6/6 [\d.]+ step/s [\d.]+s epoch 2/2 loss [\d.]+", line), line


MODEL = "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()\n"


def _quantize_command(tmp_path, *flags):
    (tmp_path / "prog_model.py").write_text(MODEL)
    code = "import sys; from lucid_fx.cli import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, "quantize", "prog_model:make", "--input-shape", "2,6", "--calib", "5",
            "-o", str(tmp_path / "q.pt"), *flags]


def test_cli_in_a_pipe_is_quiet_unless_asked(tmp_path):
    quiet = subprocess.run(_quantize_command(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and "saved:" in quiet.stdout
    lines = subprocess.run(_quantize_command(tmp_path, "--progress"), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert lines.returncode == 0, lines.stderr
    assert "\r" not in lines.stderr
    assert re.fullmatch(r"calibrate \[#{24}\] 5/5 [\d.]+ batch/s [\d.]+s\n", lines.stderr), lines.stderr


def _run_on_a_terminal(command, cwd):
    """Run ``command`` with stderr on a pseudo-terminal; returns (exit code, what it wrote there)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            process.kill()
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: the process exited
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return process.wait(timeout=60), out.decode()


def test_cli_on_a_terminal_draws_the_bar_and_no_progress_silences_it(tmp_path):
    code, err = _run_on_a_terminal(_quantize_command(tmp_path), tmp_path)
    assert code == 0, err
    assert err.startswith("\r\x1b[K") and err.endswith("\r\n")  # the terminal turns "\n" into "\r\n"
    assert re.search(r"calibrate \[#{24}\] 5/5 [\d.]+ batch/s", err)
    code, err = _run_on_a_terminal(_quantize_command(tmp_path, "--no-progress"), tmp_path)
    assert code == 0 and err == ""


@pytest.mark.parametrize("verb", ["demo", "quantize", "explain"])
def test_the_verbs_that_run_data_take_the_flag_and_show_does_not(verb, capsys):
    from lucid_fx.cli import main

    assert main([verb, "--help"]) == 0
    assert "--no-progress" in capsys.readouterr().out
    assert main(["show", "--help"]) == 0
    assert "progress" not in capsys.readouterr().out
