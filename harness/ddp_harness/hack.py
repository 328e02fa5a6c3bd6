"""Where the repository's developer scripts are: hack/build-k8s.sh, hack/k8s-versions.env and
hack/build-node-binaries.sh build and pin what the harness runs.

The harness is a development package used from a checkout; it does not copy the scripts. They are
found, first match wins:
1. $DDP_HACK_DIR, when set (it must hold k8s-versions.env);
2. the hack/ of the nearest checkout above this package's own files (an editable install or
   PYTHONPATH pointing into a checkout);
3. the hack/ of the nearest checkout above the current directory (a non-editable install run from a
   checkout)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

HACK_DIR_ENV = "DDP_HACK_DIR"
# The file that tells the repository's hack/ from any other directory of that name.
_MARKER = "k8s-versions.env"


class HackDirError(RuntimeError):
    pass


def _nearest_hack_dir(starts: Iterable[Path]) -> Path | None:
    for start in starts:
        for directory in (start, *start.parents):
            candidate = directory / "hack"
            if (candidate / _MARKER).is_file():
                return candidate
    return None


def hack_dir(environ: Mapping[str, str] = os.environ, cwd: Path | None = None) -> Path:
    """The repository's hack/ directory; raises HackDirError saying how to point at it."""
    configured = environ.get(HACK_DIR_ENV)
    if configured:
        path = Path(configured)
        if not (path / _MARKER).is_file():
            raise HackDirError(
                f"${HACK_DIR_ENV}={configured} holds no {_MARKER}: point it at the repository's hack/"
            )
        return path
    found = _nearest_hack_dir([Path(__file__).resolve().parent, (cwd or Path.cwd()).resolve()])
    if found is None:
        raise HackDirError(
            f"cannot find the repository's hack/ (with {_MARKER}): run from a checkout or set ${HACK_DIR_ENV}"
        )
    return found


def hack_file(name: str, environ: Mapping[str, str] = os.environ) -> Path:
    """A file in hack/, e.g. hack_file("build-k8s.sh")."""
    return hack_dir(environ) / name
