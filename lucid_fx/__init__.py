"""lucid_fx: post-training int8 quantization for PyTorch as torch.fx graph passes.

Two layers: :mod:`lucid_fx.quantization` holds the observers, grids and configs; the graph
passes live in :mod:`lucid_fx.passes`.
"""

from lucid_fx import quantization

__version__ = "0.1.0"

__all__ = ["quantization", "__version__"]
