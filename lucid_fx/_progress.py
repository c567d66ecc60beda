"""The progress bar of calibrate, quantize, the CLI and the demo's training: tqdm's behaviour,
without the dependency.

``progress`` is tri-state, as tqdm's ``disable=None``: ``None`` (every verb's default) draws the bar
when the stream is a terminal and writes nothing otherwise; ``True`` also reports when the stream
is a file or pipe, line-wise (one line every ``LINE_EVERY_S`` seconds and a last one), so a log
never receives ``\\r`` frames; ``False`` writes nothing.
"""

from __future__ import annotations

import time
from typing import Optional, TextIO

__all__ = ["Progress", "progress_enabled"]

# A terminal redraw at most this often: a fast loop spends no time writing frames.
REDRAW_EVERY_S = 0.1
# A log gets a line this often on a long run, not one per batch.
LINE_EVERY_S = 10.0
WIDTH = 24


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_enabled(progress: Optional[bool], stream: TextIO) -> bool:
    """Whether a verb given ``progress`` reports on ``stream`` at all."""
    return is_terminal(stream) if progress is None else bool(progress)


class Progress:
    """Counts steps of ``label`` and reports them on ``stream``: redrawn in place on a terminal,
    as plain lines elsewhere."""

    def __init__(self, label: str, total: Optional[int], stream: TextIO, progress: Optional[bool], unit: str = "batch") -> None:
        self.label, self.total, self.stream, self.unit = label, total, stream, unit
        self.enabled = progress_enabled(progress, stream)
        self.terminal = is_terminal(stream)
        self.start = self.last = time.perf_counter()
        self.count = 0
        self.note = ""

    def step(self, note: str = "") -> None:
        self.count += 1
        self.note = note or self.note
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last >= (REDRAW_EVERY_S if self.terminal else LINE_EVERY_S):
            self.last = now
            self._write("\r" if self.terminal else "\n")

    def close(self) -> None:
        if self.enabled and self.count:
            self._write("\n")

    def text(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        if self.total:
            done = int(WIDTH * self.count / self.total)
            bar = f"[{'#' * done}{'.' * (WIDTH - done)}] {self.count}/{self.total}"
        else:
            bar = f"{self.count} {self.unit}es" if self.unit.endswith("ch") else f"{self.count} {self.unit}s"
        note = f" {self.note}" if self.note else ""
        return f"{self.label} {bar} {self.count / elapsed:.1f} {self.unit}/s {elapsed:.1f}s{note}"

    def _write(self, end: str) -> None:
        # "\r" + clear to the end of the line: a shorter frame leaves no tail of a longer one.
        prefix = "\r\x1b[K" if self.terminal else ""
        self.stream.write(prefix + self.text() + end)
        self.stream.flush()
