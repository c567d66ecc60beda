"""Where a rule was defined: ``file:line`` of the caller, so explain() can say which rule fired; and the
``stacklevel`` that points a warning at the user's line."""

import os
import sys


def caller_location(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    path = frame.f_code.co_filename
    parts = path.replace(os.sep, "/").split("/")
    # Keep paths short and stable: from the package (or passes) folder down.
    for anchor in ("lucid_fx", "passes", "tests", "examples"):
        if anchor in parts:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
            break
    return f"{path}:{frame.f_lineno}"


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller of this function that points at the first frame
    outside torch, lucid_fx and the code torch.fx generated: the user's line that ran the model or the calibration
    (a fixed level pointed at torch's ``Module._call_impl``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        inside = name.split(".")[0] in ("torch", "lucid_fx") or frame.f_code.co_filename.startswith("<eval_with_key")
        if not inside:
            return level
        frame, level = frame.f_back, level + 1
    return 1
