"""Files only their owner may read (credentials, keys, passwords): mode 0600 from their
creation, written whole, safe for two first runs at once."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: Path, text: str, *, replace: bool = True) -> bool:
    """``text`` into ``path``, mode 0600 from its creation, written beside it and then moved in
    whole: a reader sees the old file or the new one, never a part. ``replace=False`` keeps a
    file that is there already (two first runs at once: one file wins, both read it); returns
    whether ``path`` now holds ``text``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # fails when the file is there: never overwrites
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)
