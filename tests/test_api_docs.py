"""docs/api.md documents every public name, with the real signature, and the docs' links resolve.

An entry is a heading line ``### `lucid_fx.prepare(model, qconfig_mapping=None, ...)` `` (the
qualified name, then for a function or class its parameters as :func:`render_signature` writes
them), followed by a paragraph that links to a page with examples.
"""

import dataclasses
import enum
import importlib
import inspect
import re
from pathlib import Path

import pytest

import lucid_fx
import lucid_fx.quantization

DOCS = Path(__file__).resolve().parents[1] / "docs"
API = (DOCS / "api.md").read_text()
MODULES = (lucid_fx, lucid_fx.quantization)
HEADING = re.compile(r"^### `([\w.]+?)(\(.*\))?`$", re.M)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(#[\w-]+)?\)")


def _default_text(obj, param: inspect.Parameter) -> str:
    default = param.default
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        field = {f.name: f for f in dataclasses.fields(obj)}.get(param.name)
        if field is not None and field.default_factory is not dataclasses.MISSING:
            return repr(field.default_factory())  # `<factory>` says nothing; the value does
    if isinstance(default, type):
        return default.__qualname__
    return repr(default)


def render_signature(obj) -> str:
    """``(a, b=1, *, c=None, **kw)``: parameter names and default values, no annotations."""
    parts, star_done = [], False
    params = list(inspect.signature(obj).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = p.name if p.default is p.empty else f"{p.name}={_default_text(obj, p)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def _needs_signature(obj) -> bool:
    if isinstance(obj, type):
        return not issubclass(obj, enum.Enum)  # an enum is documented by its members
    return inspect.isfunction(obj)


def _entries() -> dict:
    return {m.group(1): m.group(2) for m in HEADING.finditer(API)}


def _resolve(qualified: str):
    owner, _, name = qualified.rpartition(".")
    module = importlib.import_module(owner)
    assert name in module.__all__, f"docs/api.md documents {qualified}, which is not in {owner}.__all__"
    return getattr(module, name)


PUBLIC = [f"{m.__name__}.{name}" for m in MODULES for name in m.__all__]


def test_every_public_name_has_an_entry():
    missing = [name for name in PUBLIC if name not in _entries()]
    assert not missing, f"docs/api.md has no `### `{missing[0]}...`` entry; missing: {missing}"


def test_every_entry_is_a_public_name():
    for qualified in _entries():
        _resolve(qualified)


@pytest.mark.parametrize("qualified", PUBLIC)
def test_entry_signature_matches_the_code(qualified):
    written = _entries().get(qualified)
    if qualified not in _entries():
        pytest.fail(f"{qualified} is not documented in docs/api.md")
    obj = _resolve(qualified)
    if _needs_signature(obj):
        expected = render_signature(obj)
        assert written == expected, f"docs/api.md: {qualified}{written} but the code has {qualified}{expected}"
    else:
        assert written is None, f"docs/api.md: {qualified} is a value ({type(obj).__name__}); write no parameters"


def test_every_entry_links_to_a_page_with_examples():
    sections = re.split(r"^### ", API, flags=re.M)[1:]
    for section in sections:
        name = section.split("`")[1]
        pages = [m.group(1) for m in LINK.finditer(section)]
        assert pages, f"docs/api.md: the entry for {name} links to no page"


def _anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no "# comments" in code
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for match in LINK.finditer(path.read_text()):
        target, anchor = match.group(1), match.group(2)
        if "://" in target:
            continue
        assert (path.parent / target).is_file(), f"{path.name} links to {target}, which does not exist"
        if anchor:
            assert anchor[1:] in _anchors(path.parent / target), f"{path.name} links to {target}{anchor}: no such heading"


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    linked = {m.group(1) for m in LINK.finditer(index)}
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"


def test_render_signature_formats():
    def f(a, /, b, *args, c=None, **kw):
        pass

    def g(x, *, y=(1,)):
        pass

    assert render_signature(f) == "(a, /, b, *args, c=None, **kw)"
    assert render_signature(g) == "(x, *, y=(1,))"
    assert render_signature(lucid_fx.Explanation) == "(rows, report='')"


def test_anchor_slugs(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n## One call: `quantize`\n```bash\n# not a heading\n```\n### A new op\n")
    assert _anchors(page) == {"title", "one-call-quantize", "a-new-op"}
