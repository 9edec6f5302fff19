"""The torch and Triton versions this library is tested with, and what is unsupported outside them.

CI runs the full suite on the newest pair (torch 2.13 + Triton 3.9) and the version-sensitive
subset (.ci/old_pair.sh) on the oldest (torch 2.11 + Triton 3.6); pyproject.toml's lower bounds
are that oldest pair. :func:`problems` turns the running versions into sentences (what is
unsupported, why, how to fix it); ``python -m megalodon_kernels`` prints them before its
self-check. Nothing here raises on a bad version: ``import megalodon_kernels`` must keep working
so that this report can be printed.

This module sits at the package root, not in ``ops/``: importing ``ops._versions`` would run
``ops/__init__.py``, which registers every op and is exactly what may fail on an untested torch.
It imports neither torch nor triton itself (the caller passes the version strings), so a broken
install cannot stop it either.
"""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["TORCH_TESTED", "TRITON_TESTED", "parse", "problems"]

#: (oldest, newest) major.minor tested in CI; versions between them are supported too.
TORCH_TESTED = ((2, 11), (2, 13))
TRITON_TESTED = ((3, 6), (3, 9))

#: Triton releases before this one have an interpreter whose ``tensor.__index__`` calls ``int()``
#: on a one-element 1-D NumPy array, which NumPy 2.4 turned from a deprecation into a TypeError
#: (triton-lang/triton#9171, fixed by #9172). Checked: 3.6.0's interpreter.py has the bare
#: ``int(self.handle.data)``, 3.7.0's and 3.9.0's squeeze first.
INTERPRETER_NUMPY_FIX = (3, 7)

# Why a version outside the range is not supported: what depends on the version, concretely.
_TORCH_WHY = ("the ops' registration as torch.library custom ops (ops/_library.py) and their "
              "torch.compile / torch.export support rely on torch behaviour that changes between "
              "releases, checked on the tested releases only")
_TRITON_WHY = ("the Triton kernels, their interpreter runs and the AOT register/spill report "
               "(bench/results/aot_*.json) are checked on the tested releases only")


def parse(version: str) -> Optional[tuple[int, ...]]:
    """(major, minor, patch) of a version string such as ``2.11.0+cu130`` or ``3.9.0.dev0``;
    None if it does not start with a number."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", version or "")
    if not m:
        return None
    return tuple(int(g) if g is not None else 0 for g in m.groups())


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def _range_problem(name: str, version: str, tested, why: str) -> Optional[str]:
    v = parse(version)
    (lo, hi) = tested
    span = f"{_fmt(lo)}-{_fmt(hi)}"
    if v is None:
        return f"{name} {version!r}: cannot read its version; tested: {name} {span}."
    if v[:2] < lo:
        return (f"{name} {version} is older than the tested range ({span}): not supported, "
                f"because {why}. Fix: pip install '{name}>={_fmt(lo)}'.")
    if v[:2] > hi:
        return (f"{name} {version} is newer than the tested range ({span}): not supported yet, "
                f"because {why}; it may work (the self-check below says what does). "
                f"Fix: pip install '{name}>={_fmt(lo)},<{hi[0]}.{hi[1] + 1}', or report what fails.")
    return None


def problems(torch_version: str, triton_version: Optional[str], numpy_version: str,
             interpret: bool) -> list[str]:
    """Sentences saying what is unsupported about these versions (empty: all supported).

    ``triton_version`` is None when Triton is not installed (the torch, CPU and CUDA backends do
    not need it: not a problem). ``interpret``: whether ``TRITON_INTERPRET=1`` (the Triton
    kernels run on CPU tensors in Triton's interpreter).
    """
    out = []
    p = _range_problem("torch", torch_version, TORCH_TESTED, _TORCH_WHY)
    if p:
        out.append(p)
    if triton_version is not None:
        p = _range_problem("triton", triton_version, TRITON_TESTED, _TRITON_WHY)
        if p:
            out.append(p)
        p = interpreter_problem(triton_version, numpy_version) if interpret else None
        if p:
            out.append(p + " Compiled Triton on a GPU is not affected.")
    return out


def interpreter_problem(triton_version: str, numpy_version: str) -> Optional[str]:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``) cannot run the kernels with these
    versions, or None. The Triton backends refuse CPU tensors with this sentence."""
    tv, nv = parse(triton_version), parse(numpy_version)
    if tv is None or nv is None or tv[:2] >= INTERPRETER_NUMPY_FIX or nv[:2] < (2, 4):
        return None
    return (f"triton {triton_version} with numpy {numpy_version} and TRITON_INTERPRET=1: Triton's "
            f"interpreter before {_fmt(INTERPRETER_NUMPY_FIX)} fails in every kernel that loops "
            f"over a runtime bound (TypeError: only 0-dimensional arrays can be converted to Python "
            f"scalars), because it converts a one-element array with int(), which NumPy 2.4 made an "
            f"error. Fix: pip install 'numpy<2.4', or 'triton>={_fmt(INTERPRETER_NUMPY_FIX)}'.")
