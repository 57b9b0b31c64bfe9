"""Atomic build output: write into a staging folder beside the output, swap it in at the end.

A build that fails or is interrupted removes its staging folder and leaves the previous output as
it was; one killed outright leaves only a hidden staging folder, which the next build removes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_STAGING = ".{name}.staging-{pid}"
_RETIRED = ".{name}.retired-{pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(output: Path, pattern: str) -> list[tuple[Path, int]]:
    prefix = pattern.format(name=output.name, pid="")
    found = []
    for p in output.parent.glob(prefix + "*"):
        pid = p.name[len(prefix):]
        if pid.isdigit():
            found.append((p, int(pid)))
    return found


def recover(output: Path) -> None:
    """Undo what a killed build left: a retired output with no output (killed mid-swap) is put
    back; staging folders of processes that are gone are removed."""
    if not output.parent.is_dir():
        return
    for retired, pid in _leftovers(output, _RETIRED):
        if _pid_alive(pid) and pid != os.getpid():
            continue
        if not output.exists():
            retired.rename(output)
        else:
            shutil.rmtree(retired, ignore_errors=True)
    for staging, pid in _leftovers(output, _STAGING):
        if not _pid_alive(pid) or pid == os.getpid():
            shutil.rmtree(staging, ignore_errors=True)


def make_staging(output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    recover(output)
    staging = output.parent / _STAGING.format(name=output.name, pid=os.getpid())
    staging.mkdir()
    return staging


def publish(staging: Path, output: Path) -> None:
    """Move `staging` to `output`, replacing it. Two renames; `recover` repairs a kill between them."""
    retired = None
    if output.exists():
        retired = output.parent / _RETIRED.format(name=output.name, pid=os.getpid())
        output.rename(retired)
    staging.rename(output)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def link_tree(src: Path, dst: Path) -> None:
    """Reuse a cached stage folder: hard links where the filesystem allows (files are never
    modified in place), copies elsewhere."""
    shutil.copytree(src, dst, copy_function=link_or_copy)


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
