"""Where a rule was defined: ``file:line`` of the caller, so explain() can say which rule fired."""

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
