"""Run a script on a disk that fills: ``python tests/full_disk.py NAME:N SCRIPT ARGS...`` runs SCRIPT with ARGS,
and from the N-th file opened for writing that is named NAME, or lies in a folder named NAME, on, each write puts
half its bytes on the disk and raises OSError(ENOSPC), as a full disk does. Nothing else is changed."""

from __future__ import annotations

import builtins
import errno
import os
import runpy
import sys
from pathlib import Path
from typing import Any

name, nth = sys.argv[1].rsplit(":", 1)
real_open = builtins.open
opened = 0


class FullDisk:
    def __init__(self, file: Any, path: str) -> None:
        self.file, self.path = file, path

    def write(self, data: bytes) -> int:
        self.file.write(memoryview(data)[: len(data) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.file, attribute)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


def open_filling(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    global opened
    f = real_open(file, mode, *args, **kwargs)
    if "w" in mode and name in (Path(file).name, Path(file).parent.name):
        opened += 1
        if opened >= int(nth):
            return FullDisk(f, str(file))
    return f


builtins.open = open_filling
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
