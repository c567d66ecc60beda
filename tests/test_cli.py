"""The lucid-fx command line: demo, quantize, explain, and one-line errors with exit code 2."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import lucid_fx
from lucid_fx.cli import main

MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return torch.sigmoid(self.fc(x.mean((2, 3))))


def make():
    torch.manual_seed(0)
    return Net()


NOT_CALLABLE = 3


def broken():
    raise RuntimeError("factory exploded")


def not_a_module():
    return [1, 2]


class Tagger(nn.Module):
    """Keyword token inputs, as a transformers model takes them, and a branch on the sequence length
    that torch.fx cannot trace (prepare captures it with torch.export)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if input_ids.shape[1] > 2:
            h = h + torch.relu(self.fc(h))
        h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head(h)


def make_tagger():
    torch.manual_seed(0)
    return Tagger()


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 8)

    def forward(self, x, y):
        return torch.relu(self.a(x) + self.b(y))


def make_pair():
    torch.manual_seed(0)
    return Pair()


class Wrapped(nn.Module):
    """A forward whose signature hides its inputs, as a decorator's ``*args`` does."""

    def __init__(self):
        super().__init__()
        self.pair = Pair()

    def forward(self, *args):
        return self.pair(*args)


def make_wrapped():
    return Wrapped()
'''

ENTRY_POINT = Path(sys.executable).parent / "lucid-fx"


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A user module ``cli_models`` in a temp folder on sys.path (and a broken ``cli_broken``)."""
    (tmp_path / "cli_models.py").write_text(MODELS)
    (tmp_path / "cli_broken.py").write_text('raise ValueError("bad config")\n')
    for name in ("cli_models", "cli_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _number(pattern, text):
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{pattern!r} not in:\n{text}"
    return float(match.group(1))


def test_demo_quick_int8_within_one_point_of_fp32(capsys, tmp_path):
    page = tmp_path / "demo.html"
    assert main(["demo", "--quick", "--html", str(page), "--progress"]) == 0
    captured = capsys.readouterr()
    fp32 = _number(r"^fp32 accuracy: ([\d.]+)%$", captured.out)
    int8 = _number(r"^int8 accuracy: ([\d.]+)%", captured.out)
    assert fp32 > 75, "the demo CNN did not learn the task (chance is 10%)"
    assert abs(fp32 - int8) <= 1.0
    assert _number(r"^speedup: ([\d.]+)x$", captured.out) > 0
    assert _number(r"^int8 latency: ([\d.]+) ms/batch", captured.out) > 0
    worst = re.search(r"^worst nodes \(SQNR vs fp32 on a held-out batch\): (.*)$", captured.out, re.M).group(1)
    assert len(worst.split("; ")) == 3 and all(_number(r"([\d.]+) dB$", w) > 10 for w in worst.split("; "))
    assert f"graph: {page} (open it in a browser" in captured.out
    text = page.read_text()
    assert text.count('<g class="node ') > 15 and '<option value="error" selected>' in text
    fp32_mb = _number(r"^model size: fp32 ([\d.]+) MB", captured.out)
    int8_mb = _number(r"^model size: .* int8 ([\d.]+) MB", captured.out)
    assert int8_mb < fp32_mb / 2
    assert re.search(r"^explain: .*fixed: 1", captured.out, re.MULTILINE)  # the sigmoid gate
    assert re.search(r"^convert: backend cpu: \d+ int8 kernels, 0 ops in float$", captured.out, re.MULTILINE)
    # progress, of the training too, goes to stderr as lines (capsys is no terminal), the results to stdout
    assert re.search(r"^train \[#{24}\] (\d+)/\1 .* epoch (\d+)/\2 loss [\d.]+$", captured.err, re.M), captured.err
    assert re.search(r"^calibrate \[#{24}\] (\d+)/\1 ", captured.err, re.M) and "\r" not in captured.err
    assert "calibrate [" not in captured.out and "train [" not in captured.out
    assert re.search(r"^time: train [\d.]+s, quantize [\d.]+s, latency [\d.]+s, compare [\d.]+s, graph [\d.]+s$", captured.out, re.M)


@pytest.mark.parametrize("threads, said", [(1, "1 thread,"), (2, "2 threads,")])
def test_demo_counts_its_threads_in_words(monkeypatch, threads, said):
    from lucid_fx.demo import _cpu_note

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert _cpu_note().startswith(f"oneDNN int8, {said} ")


def test_demo_writes_its_page_to_the_temporary_folder_by_default(monkeypatch, tmp_path, capsys):
    import lucid_fx.demo

    seen = {}
    monkeypatch.setattr(lucid_fx.demo, "run_demo", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quick"]) == 0
    assert seen["html"] == Path(tempfile.gettempdir()) / "lucid_fx_demo.html"
    assert main(["demo", "--quick", "--html", "-"]) == 0 and seen["html"] is None
    assert main(["demo", "--html", "out/page.html"]) == 2  # no such folder: said, not created in the cwd
    assert "cannot write 'out/page.html': folder 'out' does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_quantize_saves_a_model_that_loads_and_runs(models, capsys, sqnr_db):
    out = models / "q.pt"
    args = ["quantize", "cli_models:make", "--input-shape", "2,3,16,16", "--calib", "4", "-o", str(out), "--no-progress"]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "explain: fixed: 1, fused: 2, statistics: 4" in stdout
    assert "convert: backend cpu: 4 int8 kernels, 0 ops in float" in stdout
    assert f"saved: {out}" in stdout

    qmodel = lucid_fx.load(out)
    assert "torch.ops.lucid_fx.conv2d" in qmodel.code
    import cli_models

    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert sqnr_db(cli_models.make().eval()(x), qmodel(x)) > 25


def test_show_draws_a_saved_model_without_running_pickled_code(models, capsys):
    out = models / "q.pt"
    assert main(["quantize", "cli_models:make", "--input-shape", "2,3,16,16", "--calib", "2", "-o", str(out), "--no-progress"]) == 0
    assert "load it with `lucid_fx.load(path)` (no pickled code runs)" in capsys.readouterr().out
    torch.load(out, weights_only=True)  # the file is data: loads with the safe unpickler
    page = models / "graph.html"
    assert main(["show", str(out), "-o", str(page), "--layout", "layered"]) == 0
    lines = capsys.readouterr().out.splitlines()
    graph = lucid_fx.to_networkx(lucid_fx.load(out))
    assert lines[0].startswith(f"{out}: QuantizedModule, {graph.number_of_nodes()} nodes (")
    assert "fixed 1" in lines[0] and "int8 " in lines[0] and lines[1] == f"wrote {page}"
    text = page.read_text()
    assert text.count('<g class="node ') == graph.number_of_nodes() and "FixedQParamsObserver" in text
    assert main(["show", str(out), "-o", str(models / "graph.graphml")]) == 0


def test_show_refuses_files_it_did_not_write(models, capsys):
    torch.save({"weights": torch.zeros(2)}, models / "plain.pt")
    assert main(["show", str(models / "plain.pt"), "-o", str(models / "g.html")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "was not written by lucid_fx.save" in err[0] and err[1].startswith("  hint: show reads files written by lucid_fx.save")
    assert main(["show", str(models / "missing.pt"), "-o", str(models / "g.html")]) == 2
    assert "'" + str(models / "missing.pt") + "': no such file" in capsys.readouterr().err
    assert main(["show", str(models / "plain.pt"), "-o", str(models / "g.png")]) == 2
    assert "unknown suffix '.png'" in capsys.readouterr().err
    assert not (models / "g.html").exists()


def test_explain_prints_the_table(models, capsys):
    assert main(["explain", "cli_models:make", "--input-shape", "1,3,16,16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["node", "op", "spelling", "kind", "observer", "qparams", "runs", "rule", "reason"]
    sigmoid = next(line for line in lines if line.startswith("sigmoid"))
    # read only by the linear before it: that linear's post-op (rules/lowering_elementwise.py)
    assert "fixed" in sigmoid and "[0, 1] scale=0.00390625 zp=0" in sigmoid and "int8 kernel (sigmoid)" in sigmoid
    assert lines[-1] == "summary: fixed: 1, fused: 2, statistics: 4"


def test_explain_takes_a_file_path_and_calibrates_on_request(models, capsys):
    spec = f"{models / 'cli_models.py'}:make"
    assert main(["explain", spec, "--input-shape", "1,3,16,16", "--calib", "2", "--no-progress"]) == 0
    relu = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("relu"))
    assert "scale=" in relu  # calibrated: statistics observers now have qparams


def test_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "quantize" in capsys.readouterr().out
    assert main(["quantize", "--help"]) == 0
    assert "random" in capsys.readouterr().out  # says the inputs are random
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("lucid-fx ")


SHAPE = ["--input-shape", "1,3,16,16"]
ERRORS = [
    (["explain", "no_colon", *SHAPE], "expected MODULE:FACTORY, got 'no_colon'"),
    (["explain", "no_such_module_xyz:make", *SHAPE], "cannot import module 'no_such_module_xyz': no module named 'no_such_module_xyz'"),
    (["explain", "cli_broken:make", *SHAPE], "importing 'cli_broken' failed: ValueError: bad config"),
    (["explain", "cli_models:missing", *SHAPE], "module 'cli_models' has no attribute 'missing'"),
    (["explain", "cli_models:NOT_CALLABLE", *SHAPE], "cli_models:NOT_CALLABLE is not callable (it is of type int)"),
    (["explain", "cli_models:broken", *SHAPE], "calling cli_models:broken() failed: RuntimeError: factory exploded"),
    (["explain", "cli_models:not_a_module", *SHAPE], "cli_models:not_a_module() returned an object of type list, not a torch.nn.Module"),
    (["explain", "cli_models:make", "--input-shape", "1,x"], "bad --input-shape '1,x': expected positive integers separated by commas"),
    (["explain", "cli_models:make"], "give --input-shape (random float input) or --calib-data (your batches)"),
    (
        ["explain", "cli_models:make", "--input-shape", "1,5,16,16"],
        "the model's forward failed on a random float input of shape (1, 5, 16, 16): RuntimeError: ",
    ),
    (["quantize", "cli_models:make", *SHAPE, "-o", "/no/such/folder/q.pt"], "cannot write '/no/such/folder/q.pt': folder '/no/such/folder' does not exist"),
    (["quantize", "cli_models:make", *SHAPE, "--calib", "0", "-o", "q.pt"], "argument --calib: expected an integer >= 1, got '0'"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate' (choose from 'demo', 'quantize', 'explain', 'show')"),
]


@pytest.mark.parametrize("args, message", ERRORS, ids=[m.split(":")[0][:40] for _, m in ERRORS])
def test_errors_are_one_line_and_a_hint_with_exit_code_2(models, capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2, captured.err
    assert lines[0].startswith(f"lucid-fx: error: {message}")
    assert lines[1].startswith("  hint: ") and len(lines[1]) > len("  hint: ")
    assert captured.out == ""


@pytest.mark.parametrize("factory, takes, example", [
    ("make_pair", "2 inputs (x, y)", "(x, y)"),
    ("make_wrapped", "more than one input", "(x, y)"),
])
def test_a_model_of_several_inputs_is_sent_to_calib_data(models, capsys, factory, takes, example):
    assert main(["quantize", f"cli_models:{factory}", "--input-shape", "4,8", "-o", str(models / "q.pt")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("lucid-fx: error: the model's forward failed on a random float input of shape (4, 8): "
                             "TypeError: "), err[0]
    assert err[1] == (f"  hint: forward takes {takes} and --input-shape makes only one: drop --input-shape and pass "
                      "--calib-data FILE holding a list of batches, each a tuple of forward's inputs in order or a dict "
                      f"of them by name, e.g. torch.save([{example}, ...], FILE)")


@pytest.mark.same_on_every_cpu  # the installed script's plumbing; its kernels are the module's
def test_installed_entry_point_quantizes(models, tmp_path_factory):
    out = models / "q.pt"
    elsewhere = tmp_path_factory.mktemp("cwd")  # the module is found through PYTHONPATH, not the cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(models), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [str(ENTRY_POINT), "quantize", "cli_models:make", "--input-shape", "1,3,16,16", "--calib", "2", "-o", str(out)],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "convert: backend cpu: 4 int8 kernels, 0 ops in float" in proc.stdout
    assert proc.stderr == ""  # a pipe, not a terminal: no progress bar in the log
    assert lucid_fx.load(out)(torch.randn(3, 3, 16, 16)).shape == (3, 4)


@pytest.mark.same_on_every_cpu  # error plumbing: nothing converts
def test_python_dash_m_reports_errors_the_same_way(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lucid_fx", "explain", "no_such_module_xyz:make", "--input-shape", "1,3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "python -m lucid_fx: error: cannot import module 'no_such_module_xyz': no module named 'no_such_module_xyz'"
    )
    assert "Traceback" not in proc.stderr


TOP_LEVEL_FLOAT = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.b = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:  # data-dependent: torch.fx cannot trace the top level
            y = y * 2
        return self.b(y)


def make():
    torch.manual_seed(0)
    return Branchy()
'''


def test_quantize_of_a_top_level_that_stays_float_says_what_to_do_and_saves_with_allow(models, capsys):
    (models / "cli_branchy.py").write_text(TOP_LEVEL_FLOAT)
    out = models / "b.pt"
    base = ["quantize", "cli_branchy:make", "--input-shape", "1,3,12,12", "--calib", "2", "-o", str(out)]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "error: cannot save cli_branchy:make's model as data: Branchy stayed float (<root> (Branchy) at " in err
    assert "TraceError" in err and "hint: rerun with --allow cli_branchy:Branchy to save it" in err
    assert not out.exists()
    assert main(base + ["--allow", "cli_branchy:Branchy"]) == 0
    stdout = capsys.readouterr().out
    # one report for the model: both convs int8, 2*8*(10*10)*(3*3*3) + 2*4*(10*10)*8 FLOPs, the root's own code float
    assert ("convert: backend cpu: 2 int8 kernels, 0 ops in float\nint8 FLOPs: 100.0% of 49.6 kFLOP\n"
            "  float module: <root> (Branchy) at ") in stdout
    assert "load it with `lucid_fx.load(path, allow=[cli_branchy.Branchy])`" in stdout
    import cli_branchy

    loaded = lucid_fx.load(out, allow=[cli_branchy.Branchy])
    x = torch.randn(1, 3, 12, 12)
    assert type(loaded).__name__ == "Branchy" and loaded(x).shape == (1, 4, 10, 10)
    assert main(["show", str(out), "-o", str(models / "g.html")]) == 2
    assert "hint: a class of yours that stayed float in the model: pass --allow MODULE:CLASS" in capsys.readouterr().err
    assert main(["show", str(out), "--allow", "cli_branchy:Branchy", "-o", str(models / "g.html")]) == 0
    assert "Branchy, 12 nodes (boundary 2, int8 6, io 4)" in capsys.readouterr().out
