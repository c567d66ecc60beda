"""Colours and node labels, shared by every renderer so that all formats look alike."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["DOMAIN_COLORS", "error_color", "node_lines", "node_size", "node_colors", "CHAR_WIDTH", "LINE_HEIGHT", "FONT_PX"]

#: domain -> (fill, stroke). Float fallbacks are orange: they are where a user looks first.
DOMAIN_COLORS: Dict[str, Tuple[str, str]] = {
    "int8": ("#c8e6c9", "#2e7d32"),
    "fixed": ("#e1bee7", "#6a1b9a"),
    "float": ("#ffe0b2", "#e65100"),
    "boundary": ("#e3f2fd", "#1565c0"),
    "io": ("#eeeeee", "#424242"),
    "const": ("#fafafa", "#9e9e9e"),
}

FONT_PX = 11.0  # the node labels' font size, in drawing units
CHAR_WIDTH = 6.8  # px per character of the 11px monospace label font
LINE_HEIGHT = 14.0


def error_color(sqnr_db: float) -> str:
    """Green at 40 dB and above, through yellow, to red at 15 dB and below."""
    t = min(1.0, max(0.0, (sqnr_db - 15.0) / 25.0))
    hue = 120.0 * t
    return f"hsl({hue:.0f}, 70%, 78%)"


def node_lines(attrs: Dict[str, Any]) -> List[str]:
    """Name; the op (or the lowering that replaced it); qparams, else shape."""
    op = attrs.get("lowering") or attrs.get("op", "")
    third = attrs.get("qparams") or attrs.get("shape") or ""
    if "sqnr_db" in attrs:
        third = f"{attrs['sqnr_db']:.1f} dB"
    return [str(attrs.get("name", "")), str(op), str(third)][: 3 if third else 2]


def node_size(attrs: Dict[str, Any]) -> Tuple[float, float]:
    lines = node_lines(attrs)
    width = max(len(line) for line in lines) * CHAR_WIDTH + 18
    return max(width, 60.0), len(lines) * LINE_HEIGHT + 10


def node_colors(attrs: Dict[str, Any], color_by: str) -> Tuple[str, str]:
    fill, stroke = DOMAIN_COLORS.get(attrs.get("domain", "float"), DOMAIN_COLORS["float"])
    if color_by == "error":
        fill = error_color(attrs["sqnr_db"]) if "sqnr_db" in attrs else "#ffffff"
    return fill, stroke
