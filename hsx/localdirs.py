"""Local directories a role writes (a local store, the spool): checked before anything is created.

A directory hsx cannot write is reported with its path, the user id hsx runs
as and the fix, before any directory or file is made.
"""

from __future__ import annotations

import os
from pathlib import Path

from hsx.errors import HsxError


class UnwritableDir(HsxError):
    """A directory hsx must write to is not writable (or cannot be created) by this user."""


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, what: str, setting: str) -> Path:
    """``path`` (absolute) if this user can write it, or create it; nothing is created here.

    ``what`` names the directory (e.g. "spool"), ``setting`` the flag and variable that choose it.
    """
    path = Path(path).expanduser().absolute()
    existing = _nearest_existing(path)
    uid = os.getuid()
    fix = f"create it for this user (`install -d -o {uid} {path}`) or choose another with {setting}"
    if not existing.is_dir():
        raise UnwritableDir(f"{what} {path}: {existing} is not a directory; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise UnwritableDir(f"{what} {path} {why} by uid {uid}; {fix}")
    return path


def ensure_dir(path: Path, what: str, setting: str) -> Path:
    """``check_writable``, then create ``path`` (and parents)."""
    path = check_writable(path, what, setting)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only filesystem, or a race with a permission change
        raise UnwritableDir(f"{what} {path} cannot be created by uid {os.getuid()} ({exc.strerror}); create it "
                            f"for this user (`install -d -o {os.getuid()} {path}`) or choose another with {setting}"
                            ) from None
    return path
