"""Visualise and compare: where does a quantized ResNet-like CNN lose accuracy?

Quantizes the ResNet-18-like model of benchmarks/models.py, measures every node's error against
fp32 with lucid_fx.compare, prints the worst nodes, and writes the converted graph as a
self-contained HTML page coloured by error (plus the prepared graph coloured by domain, and a
GraphML file for other tools).

    python examples/visualize_and_compare.py [--quick] [--out FOLDER]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import lucid_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from models import ResNetLike  # noqa: E402


def main(quick: bool = False, out: Path | None = None) -> lucid_fx.Comparison:
    out = Path(out or tempfile.mkdtemp(prefix="lucid_fx_"))
    torch.manual_seed(0)
    size, batches = (64, 4) if quick else (224, 16)
    model = ResNetLike().eval()
    data = [torch.randn(1, 3, size, size) for _ in range(batches)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    qmodel = lucid_fx.convert(prepared)

    held_out = [torch.randn(1, 3, size, size) for _ in range(2)]
    errors = lucid_fx.compare(model, qmodel, held_out)
    print(errors.table(limit=8))
    worst = errors.rows[0]
    print(f"worst node: {worst.node} ({worst.op}, {worst.domain}) at {worst.sqnr_db:.1f} dB")

    graph = lucid_fx.to_networkx(qmodel, comparison=errors)
    domains = {}
    for _, attrs in graph.nodes(data=True):
        domains[attrs["domain"]] = domains.get(attrs["domain"], 0) + 1
    print("converted graph: " + ", ".join(f"{k} {v}" for k, v in sorted(domains.items())))

    pages = [
        lucid_fx.visualize(qmodel, out / "converted.html", compare=errors, title="ResNet-like, int8, coloured by SQNR"),
        lucid_fx.visualize(prepared, out / "prepared.html", title="ResNet-like, prepared, coloured by domain"),
        lucid_fx.visualize(qmodel, out / "converted.graphml", compare=errors),
    ]
    for page in pages:
        print(f"wrote {page} ({page.stat().st_size / 1024:.0f} KiB)")
    return errors


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64x64 inputs, fewer batches")
    parser.add_argument("--out", type=Path, help="folder for the pages (default: a new temp folder)")
    args = parser.parse_args()
    main(quick=args.quick, out=args.out)
