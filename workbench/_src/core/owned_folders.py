"""Private folders in the temp folder named after the process that made them, `<prefix><pid>-*`,
so that a killed process's folders can be removed by the next process of the same user (a
process killed by a signal runs no clean-up: decision 17). Here in core/ because every layer
makes such folders: a launcher's heal checkpoints (launch/), a pool's sockets and logs and a
local Ray instance's root (placements/)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

# The private folders a process of ours makes in the temp folder, each named `<prefix><pid>-*`.
OWNED_PREFIXES = (
    "workbench-channel-",
    "workbench-cluster-",
    "workbench-fork-server-",
    "workbench-heal-",
    "wbray-",
)


def pid_alive(pid: int) -> bool:
    """pid runs (a zombie, dead but not yet reaped by its parent, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # (field 3 of proc(5), after the name)
    except (OSError, IndexError):
        return False
    return state != "Z"


def remove_folders_of_dead_owners(base: str) -> list[str]:
    """Removes the folders `<prefix><pid>-*` (OWNED_PREFIXES) in `base` whose owner (that pid) is
    gone and that this user owns: a process killed by a signal runs no clean-up, and its private
    folders (sockets, logs, a Ray instance's root) would stay for good. A folder whose pid runs
    again (reused by another process) is left alone: wrongly kept beats wrongly removed. Returns
    the names removed."""
    pattern = re.compile("(?:" + "|".join(map(re.escape, OWNED_PREFIXES)) + r")(\d+)-\w+")
    removed = []
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for entry in entries:
        found = pattern.fullmatch(entry)
        if found is None or int(found.group(1)) == os.getpid() or pid_alive(int(found.group(1))):
            continue
        path = os.path.join(base, entry)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(entry)
    return removed


def owned_folder(prefix: str, base: str | None = None) -> str:
    """A new private folder (mkdtemp: 0700) named `<prefix><our pid>-*` in `base` (the temp folder
    by default), after removing the folders there of owners that are gone: a killed process's
    folders go at the next start of any process of this user (a listing and a /proc read each)."""
    assert prefix in OWNED_PREFIXES, prefix
    base = base or tempfile.gettempdir()
    remove_folders_of_dead_owners(base)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
