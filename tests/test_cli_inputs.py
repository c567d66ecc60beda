"""The CLI's own batches (``--calib-data``, lucid_fx/_cli_inputs.py): a tensor of samples, or a list
of batches, each a tensor, a tuple of positional inputs or a dict of keyword inputs (a tokenizer's
output); ``--dynamic``; and one error line, with a hint, for each bad file."""

import re
from pathlib import Path

import pytest
import torch

import lucid_fx
from lucid_fx.cli import main
from tests.test_cli import models  # noqa: F401 - the fixture: a user module of models on sys.path


def test_quantize_on_own_data_with_a_report(models, capsys):
    torch.manual_seed(3)
    torch.save(torch.randn(12, 3, 16, 16) * 3, models / "calib.pt")  # 12 samples -> 3 batches of 4
    report, out = models / "report.html", models / "q.pt"
    args = ["quantize", "cli_models:make", "--input-shape", "4,3,16,16", "--calib-data", str(models / "calib.pt"),
            "--report", str(report), "-o", str(out), "--no-progress"]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    table = stdout.split("error per node against fp32 on the last batch of --calib-data (worst first):\n")[1].splitlines()
    assert table[0].split()[:3] == ["node", "op", "domain"]
    assert re.match(r"model output: [\d.]+ dB SQNR over 1 batch\(es\)", next(t for t in table if t.startswith("model output")))
    assert f"report: {report} (the converted graph, coloured by error" in stdout
    page = report.read_text()
    assert page.count('<g class="node ') >= 6 and '"sqnr_db"' in page
    # Calibrated on the x3 data, not on unit-variance random batches: the input grid is ~3x wider.
    qmodel = lucid_fx.load(out)
    x_scale = next(n.args[1] for n in qmodel.graph.nodes if "quantize_per_tensor" in str(n.target))
    assert x_scale > 2.5 * 6 / 255


def _tokens(seed, batch, length):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[0, length - 2:] = 0  # padding
    return {"input_ids": torch.randint(0, 50, (batch, length), generator=g), "attention_mask": mask}


def test_quantize_on_keyword_token_batches(models, capsys, sqnr_db):
    """A tokenizer's batches (dicts of int64 tensors) through the CLI: no --input-shape, torch.export
    capture for the untraceable top level, and a saved model that loads and runs on new tokens."""
    data, out = models / "tokens.pt", models / "q.pt"
    torch.save([_tokens(i, 2, 8) for i in range(4)], data)
    assert main(["quantize", "cli_models:make_tagger", "--calib-data", str(data), "-o", str(out), "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert (f"4 calibration batches from {data} (batch 0: input_ids (2, 8) int64, attention_mask (2, 8) int64)"
            in stdout.splitlines()[0])
    import cli_models

    qmodel, held_out = lucid_fx.load(out), _tokens(9, 2, 8)
    assert "torch.ops.lucid_fx.linear" in qmodel.code
    with torch.no_grad():
        assert sqnr_db(cli_models.make_tagger().eval()(**held_out), qmodel(**held_out)) > 25
    with pytest.raises(ValueError, match="dynamic_shapes"):  # a static capture refuses another length, clearly
        qmodel(**_tokens(9, 2, 6))


def test_quantize_dynamic_takes_every_length(models, capsys, sqnr_db):
    data, out = models / "tokens.pt", models / "q.pt"
    torch.save([_tokens(i, 2, n) for i, n in enumerate((8, 6, 5))], data)
    args = ["quantize", "cli_models:make_tagger", "--calib-data", str(data), "-o", str(out), "--no-progress"]
    assert main(args) == 2  # lengths 8, 6, 5 on a capture of length 8
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("lucid-fx: error: calibrate failed: ValueError: calibrate: batch 1: "), err
    assert err[1] == "  hint: pass --dynamic, or give every batch the first one's shape"
    assert main([*args, "--dynamic"]) == 0
    import cli_models

    qmodel, held_out = lucid_fx.load(out), _tokens(11, 3, 7)
    with torch.no_grad():
        assert sqnr_db(cli_models.make_tagger().eval()(**held_out), qmodel(**held_out)) > 25


def test_quantize_on_positional_pairs_with_a_report(models, capsys, sqnr_db):
    data, report, out = models / "pairs.pt", models / "r.html", models / "q.pt"
    g = torch.Generator().manual_seed(0)
    torch.save([(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(8)], data)
    assert main(["quantize", "cli_models:make_pair", "--calib-data", str(data), "--report", str(report), "-o", str(out),
                 "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert "8 calibration batches from" in stdout and "(batch 0: 0 (16, 8) float32, 1 (16, 4) float32)" in stdout
    assert "error per node against fp32 on the last batch of --calib-data (worst first):" in stdout
    import cli_models

    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    with torch.no_grad():
        assert sqnr_db(cli_models.make_pair().eval()(x, y), lucid_fx.load(out)(x, y)) > 25


@pytest.mark.parametrize(
    "content, shape, message",
    [
        (None, True, "no such file"),
        ({"a": 1}, True, "holds a dict of 'a': int, not a tensor of samples or a list of batches"),
        (torch.zeros(12, 3, 16), True, "holds a tensor of shape (12, 3, 16); expected samples stacked along dim 0 with --input-shape's 4 dimensions, (N, 3, 16, 16)"),
        ([torch.zeros(4, 3, 8, 8)], True, "batch 0 is 0 (4, 3, 8, 8) float32; --input-shape 4,3,16,16 expects float batches of shape (B, 3, 16, 16)"),
        ([(torch.zeros(4, 3, 16, 16),)], True, "batch 0 is 0 (4, 3, 16, 16) float32; --input-shape 4,3,16,16 expects float batches"),
        ("pickle", True, "cannot be read safely: "),
        (torch.zeros(12, 3, 16, 16), False, "holds one tensor of samples, shape (12, 3, 16, 16): give --input-shape for the batch size"),
        ([], False, "holds an empty list, not a tensor of samples or a list of batches"),
        ([{"input_ids": torch.zeros(2, 4)}, {"ids": torch.zeros(2, 4)}], False,
         "batch 1 is not like batch 0 (ids (2, 4) float32 against input_ids (2, 4) float32)"),
        ([torch.zeros(2, 3), (torch.zeros(2, 3), torch.zeros(2, 3))], False, "batch 1 is not like batch 0"),
        ([{"input_ids": [1, 2]}], False, "batch 0 is a dict of 'input_ids': list, not a tensor, a tuple of tensors or a dict"),
        ([("x", torch.zeros(1))], False, "batch 0 is a tuple of str, Tensor, not a tensor, a tuple of tensors"),
    ],
    ids=["missing", "dict", "rank", "shape", "tuple-with-shape", "pickled-code", "samples-without-shape", "empty",
         "other-names", "other-kind", "not-a-tensor", "tuple-with-a-string"],
)
def test_bad_calibration_files(models, capsys, content, shape, message):
    path = models / "calib.pt"
    if content == "pickle":
        torch.save(Path("x"), path)  # an arbitrary object: loading it would need pickled code
    elif content is not None:
        torch.save(content, path)
    args = ["quantize", "cli_models:make", *(["--input-shape", "4,3,16,16"] if shape else []), "--calib-data", str(path),
            "-o", str(models / "q.pt")]
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"lucid-fx: error: --calib-data {str(path)!r}") and message in err[0], err[0]
    assert err[1].startswith("  hint: ")
    assert not (models / "q.pt").exists()


def test_a_batch_the_model_cannot_take_is_named(models, capsys):
    path = models / "calib.pt"
    torch.save([{"input_ids": torch.zeros(2, 4, dtype=torch.int64)}], path)
    assert main(["explain", "cli_models:make", "--calib-data", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("lucid-fx: error: the model's forward failed on the first batch of --calib-data "
                             "(input_ids (2, 4) int64): TypeError: "), err[0]
    assert err[1].startswith("  hint: a batch is forward's input")
