"""The ``lucid-fx`` command line (also ``python -m lucid_fx``).

    lucid-fx demo [--seed N] [--quick]
    lucid-fx quantize MODULE:FACTORY --input-shape 1,3,32,32 [--calib N] [--backend cpu] -o OUT.pt
    lucid-fx quantize MODULE:FACTORY --calib-data batches.pt [--dynamic] -o OUT.pt
    lucid-fx explain MODULE:FACTORY --input-shape 1,3,32,32 [--calib N]

Every failure the user can fix (a bad ``MODULE:FACTORY``, a bad shape, a model whose forward
fails on that shape, an unwritable output) ends with one ``error:`` line and one ``hint:`` line
on stderr and exit code 2, never a traceback; ``--traceback`` shows the traceback too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch import nn

import lucid_fx
from lucid_fx._cli_inputs import CLIError, Inputs, _count, _first_line, _step, call_with, example_inputs, parse_shape, read_inputs
from lucid_fx._cli_model import build_model, check_forward, device_of, load_factory
from lucid_fx._cli_save import check_saveable
from lucid_fx.kernels.target import BACKENDS

__all__ = ["main", "CLIError", "load_factory", "parse_shape"]

EXIT_USAGE = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors go through :class:`CLIError` like every other error."""

    def error(self, message: str):  # type: ignore[override]
        raise CLIError(message, f"run `{self.prog} --help` for usage")


def _prepare(args: argparse.Namespace, calibration_batches: int) -> Tuple[nn.Module, nn.Module, Inputs]:
    backend = getattr(args, "backend", "cpu")  # explain prepares for the default backend
    device = device_of(backend)
    model = build_model(args.factory, device)
    inputs = read_inputs(args, device, calibration_batches)
    check_forward(model, inputs.example, random=not getattr(args, "calib_data", None))
    dynamic = "auto" if args.dynamic else None
    prepared = _step("prepare", lambda: lucid_fx.prepare(model, example_inputs=example_inputs(inputs.example), backend=backend,
                                                         dynamic_shapes=dynamic))
    if inputs.batches:
        _step("calibrate", lambda: lucid_fx.calibrate(prepared, inputs.batches, progress=args.progress))
    return model, prepared, inputs


def _report_text(report: Any) -> str:
    if isinstance(report, dict):  # one report per prepared submodule
        return "\n".join(f"{path}: {text}" for path, text in report.items())
    return str(report)


# -- commands -----------------------------------------------------------------------------------
COMMANDS: Dict[str, Callable[[argparse.Namespace], int]] = {}


def command(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    COMMANDS[fn.__name__.removeprefix("run_")] = fn
    return fn


@command
def run_demo(args: argparse.Namespace) -> int:
    from lucid_fx.demo import DEFAULT_HTML, run_demo as demo

    html = DEFAULT_HTML if args.html is None else None if args.html in ("", "-") else Path(args.html)
    if html is not None and not html.parent.is_dir():
        raise CLIError(f"cannot write {str(html)!r}: folder {str(html.parent)!r} does not exist", "create the folder, or pass --html -")
    demo(seed=args.seed, quick=args.quick, progress=args.progress, html=html)
    return 0


@command
def run_quantize(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if not out.parent.is_dir():
        raise CLIError(f"cannot write {str(out)!r}: folder {str(out.parent)!r} does not exist", "create the folder first, or choose another -o path")
    if args.report and (not Path(args.report).parent.is_dir() or Path(args.report).suffix.lower() not in (".html", ".svg")):
        raise CLIError(f"cannot write the report {args.report!r}: it needs an existing folder and a .html or .svg name", "e.g. --report report.html")
    model, prepared, inputs = _prepare(args, args.calib)
    qmodel = _step("convert", lambda: lucid_fx.convert(prepared))
    _step("running the int8 model", lambda: call_with(qmodel, inputs.probe))
    report = Path(args.report) if args.report else None
    if report is not None:
        comparison = _step("compare", lambda: lucid_fx.compare(model, qmodel, inputs.probe))
        _step("writing the report", lambda: lucid_fx.visualize(qmodel, report, compare=comparison, title=f"lucid_fx: {args.factory}"))
    allow = [load_factory(spec) for spec in args.allow]
    check_saveable(qmodel, prepared, allow, args)
    try:
        lucid_fx.save(qmodel, out, allow=allow)
    except Exception as e:  # noqa: BLE001 - a module lucid_fx.save cannot write as data, a full disk, permissions
        raise CLIError(f"saving to {str(out)!r} failed: {_first_line(e)}", "the path must be writable; pass --traceback for details") from e
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.factory} -> {type(model).__name__}, {params:,} parameters, {inputs.text}")
    print(f"explain: {lucid_fx.explain(prepared).summary()}")
    print(f"convert: {_report_text(qmodel.lucid_fx_convert_report)}")
    if report is not None:
        where = "the last batch of --calib-data" if args.calib_data else "a random batch"
        print(f"error per node against fp32 on {where} (worst first):\n{comparison.table(10)}")
        print(f"report: {report} (the converted graph, coloured by error; open it in a browser)")
    if allow:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in allow)
        flags = "".join(f" --allow {spec}" for spec in args.allow)
        print(f"saved: {out} ({out.stat().st_size / 1e6:.3f} MB); load it with `lucid_fx.load(path, allow=[{names}])` "
              f"(that code is trusted, no pickled code runs), draw it with `lucid-fx show {out}{flags} -o graph.html`")
        return 0
    print(f"saved: {out} ({out.stat().st_size / 1e6:.3f} MB); load it with `lucid_fx.load(path)` (no pickled code runs), draw it with `lucid-fx show {out} -o graph.html`")
    return 0


@command
def run_explain(args: argparse.Namespace) -> int:
    _, prepared, _ = _prepare(args, args.calib)
    table = lucid_fx.explain(prepared)
    print(table)
    print(f"summary: {table.summary()}")
    return 0


@command
def run_show(args: argparse.Namespace) -> int:
    from lucid_fx.visualize import FORMATS

    out = Path(args.output)
    if out.suffix.lower() not in FORMATS:
        raise CLIError(f"cannot write {str(out)!r}: unknown suffix {out.suffix or '(none)'!r}", f"use one of {', '.join(sorted(FORMATS))}")
    if not out.parent.is_dir():
        raise CLIError(f"cannot write {str(out)!r}: folder {str(out.parent)!r} does not exist", "create the folder first, or choose another -o path")
    if not Path(args.saved).is_file():
        raise CLIError(f"{args.saved!r}: no such file", "pass a file written by lucid_fx.save or `lucid-fx quantize -o`")
    try:
        model = lucid_fx.load(args.saved, map_location="cpu", allow=[load_factory(spec) for spec in args.allow])
    except (ValueError, TypeError) as e:
        hint = "show reads files written by lucid_fx.save (or `lucid-fx quantize -o`), nothing else"
        if "unknown class" in str(e):
            hint = "a class of yours that stayed float in the model: pass --allow MODULE:CLASS, as given to `lucid-fx quantize`, if you trust it"
        raise CLIError(str(e).splitlines()[0], hint) from e
    path = _step("drawing the graph", lambda: lucid_fx.visualize(model, out, layout=args.layout, title=f"lucid_fx: {Path(args.saved).name}"))
    graph = lucid_fx.to_networkx(model)
    counts: Dict[str, int] = {}
    for _, attrs in graph.nodes(data=True):
        counts[attrs["domain"]] = counts.get(attrs["domain"], 0) + 1
    print(f"{args.saved}: {type(model).__name__}, {graph.number_of_nodes()} nodes (" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")")
    print(f"wrote {path}")
    return 0


# -- the parser ---------------------------------------------------------------------------------
_MODEL_HELP = (
    "the model: MODULE:FACTORY, where FACTORY() returns an nn.Module (put in eval mode); "
    "MODULE is a module name importable from the current folder or PYTHONPATH, or a path to a .py file"
)
_ALLOW_HELP = (
    "a module class of yours that stays float in the model (e.g. a top level torch.fx cannot trace): the file "
    "names it and loading trusts its code; repeatable"
)
_RANDOM_NOTE = (
    "The example input and the calibration batches are random normal float tensors of --input-shape "
    "(seeded by --seed), so the activation ranges are those of random data, not of your data: this "
    "checks that a model quantizes and shows what lucid_fx decides. For a model you deploy, calibrate "
    "on real batches: --calib-data, or the Python API (lucid_fx.prepare / calibrate / convert)."
)


def _add_model_arguments(parser: argparse.ArgumentParser, default_calib: int) -> None:
    parser.add_argument("factory", metavar="MODULE:FACTORY", help=_MODEL_HELP)
    parser.add_argument(
        "--input-shape", metavar="SHAPE",
        help="shape of forward's single float input, batch first, comma-separated: e.g. 1,3,32,32 (random inputs; "
        "with --calib-data, the batch size of a tensor of samples)",
    )
    parser.add_argument(
        "--calib", type=_count(min(default_calib, 1)), default=default_calib, metavar="N",
        help=f"number of random calibration batches (default {default_calib})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument(
        "--calib-data", metavar="FILE",
        help="calibrate on your own batches instead (read with weights_only=True): a torch.save'd list of batches, "
        "each a tensor, a tuple of forward's positional inputs or a dict of its keyword inputs (a tokenizer's "
        "input_ids, attention_mask, ...), or one tensor of samples split into batches of --input-shape's batch "
        "size; the first batch is prepare's example, the last runs the converted model",
    )
    parser.add_argument(
        "--dynamic", action="store_true",
        help="where the model is captured with torch.export (a top level torch.fx cannot trace), keep every "
        "dimension dynamic (prepare's dynamic_shapes=\"auto\"): other batch sizes and sequence lengths run",
    )


def build_parser(prog: str = "lucid-fx") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="lucid_fx: post-training int8 quantization for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {lucid_fx.__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="on an error, print the Python traceback too")
    # show calibrates nothing: only the verbs that run data through a model take the progress flag.
    progress = argparse.ArgumentParser(add_help=False, parents=[common])
    progress.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress on stderr: by default a bar on a terminal and nothing in a log or pipe; "
        "--progress also writes it line by line to a log, --no-progress never",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    demo = sub.add_parser(
        "demo", parents=[progress], help="train a small CNN on built-in synthetic data, quantize it, compare fp32 with int8",
        description="Train a small CNN (conv-bn-relu, a residual add, max-pool, a sigmoid gate, avg-pool, "
        "linear) on 10 classes of procedurally generated 1x32x32 patterns made in-process (nothing is "
        "downloaded), quantize it to int8 and print accuracy on held-out images, latency, speedup and size, "
        "fp32 against int8.",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and training (default 0)")
    demo.add_argument("--quick", action="store_true", help="a smaller, few-second run (less data, fewer epochs)")
    demo.add_argument(
        "--html", metavar="PATH",
        help="where to write the converted graph as a self-contained HTML page (default lucid_fx_demo.html in "
        "the temporary folder, not the current one; - for none)",
    )

    quantize = sub.add_parser(
        "quantize", parents=[progress], help="quantize MODULE:FACTORY's model to int8 and save it",
        description="Prepare, calibrate and convert the model that MODULE:FACTORY builds, then save the "
        "converted model with lucid_fx.save: the graph and tensors as data, which lucid_fx.load reads "
        "with torch.load(weights_only=True), so no pickled code runs. " + _RANDOM_NOTE,
    )
    _add_model_arguments(quantize, default_calib=8)
    quantize.add_argument("--backend", choices=BACKENDS, default="cpu", help="kernel backend (default cpu)")
    quantize.add_argument("-o", "--output", required=True, metavar="OUT.pt", help="where to save the converted model")
    quantize.add_argument("--allow", action="append", default=[], metavar="MODULE:CLASS", help=_ALLOW_HELP)
    quantize.add_argument(
        "--report", metavar="REPORT.html",
        help="also write the converted graph as HTML, coloured by each node's error against fp32, and print the worst nodes",
    )

    explain = sub.add_parser(
        "explain", parents=[progress], help="print which observer lucid_fx chooses for each node of MODULE:FACTORY's model, and why",
        description="Prepare the model that MODULE:FACTORY builds and print the explain table: each node's "
        "canonical op, decision, observer, qparams and the rule that decided it. " + _RANDOM_NOTE + " With "
        "the default --calib 0 only fixed grids show qparams.",
    )
    _add_model_arguments(explain, default_calib=0)

    show = sub.add_parser(
        "show", parents=[common], help="draw a saved prepared or converted model as HTML, SVG, DOT or GraphML",
        description="Load a model written by lucid_fx.save or `lucid-fx quantize -o` (no pickled code runs) and "
        "draw its graph; the format follows the -o suffix (.html is a self-contained page with pan, zoom, search "
        "and a details panel per node).",
    )
    show.add_argument("saved", metavar="SAVED", help="a file written by lucid_fx.save or `lucid-fx quantize -o`")
    show.add_argument("-o", "--output", required=True, metavar="GRAPH.html", help="where to draw it: .html, .svg, .dot, .gv or .graphml")
    show.add_argument("--allow", action="append", default=[], metavar="MODULE:CLASS", help=_ALLOW_HELP)
    show.add_argument("--layout", choices=("auto", "dot", "layered"), default="auto", help="Graphviz dot when installed (auto), or the built-in layered layout")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "lucid-fx") -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    show_traceback = "--traceback" in (sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(prog).parse_args(argv)
        return COMMANDS[args.command](args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CLIError as e:
        if show_traceback and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        print(f"{prog}: error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - a bug: still one line, and the traceback on request
        if show_traceback:
            traceback.print_exc()
        print(f"{prog}: error: unexpected {_first_line(e)}", file=sys.stderr)
        print("  hint: this is likely a lucid_fx bug; rerun with --traceback and report it", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
