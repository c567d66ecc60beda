"""lucid_fx.passes: the graph passes, one per module, each ``GraphModule -> GraphModule``.

Installed as ``lucid_fx.passes`` (see ``[tool.setuptools.package-dir]`` in pyproject.toml);
there is no top-level ``passes`` package.
"""

__all__: list = []
