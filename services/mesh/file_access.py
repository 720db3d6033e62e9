"""Why a model file cannot be read, said plainly.

Checked up front because the loaders downstream misreport it: safetensors says "No such
file or directory" for a file it may not open, a directory we may not enter makes every
file in it look absent, and a JSON or tokenizer reader's error reads like a parse
failure. A container running as a non-root uid over files an image left 0600 root is the
usual cause, so the message carries the mode, the owner and our uid. Each service raises
its own error class with it (executor: CheckpointError; router: PermissionError).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


def unreadable_reason(path: Path) -> str | None:
    """None when this process may read ``path`` (a directory: list and enter it) or when
    it is absent (the caller reports what is missing); else "<name> in <dir> cannot be
    read: permission denied (mode …, owner uid …, running as uid …)". Does not open it."""
    want = os.R_OK | os.X_OK if path.is_dir() else os.R_OK
    if os.access(path, want, effective_ids=os.access in os.supports_effective_ids):
        return None
    try:
        st = path.stat()
        detail = f"mode {oct(stat.S_IMODE(st.st_mode))}, owner uid {st.st_uid}, "
    except FileNotFoundError:
        return None  # absent, not forbidden
    except OSError:  # not even stat-able: a directory above it is closed to us
        detail = ""
    return f"{path.name} in {path.parent} cannot be read: permission denied ({detail}running as uid {os.geteuid()})"
