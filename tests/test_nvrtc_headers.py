"""The NVRTC include path when the header wheels are split between two folders of the ``nvidia``
namespace package (a GPU image's site-packages plus a ``pip install --target`` folder on
PYTHONPATH): CuTe includes libcu++ both as <cuda/std/...> and as <cccl/cuda/std/...>, so both
spellings must resolve, whichever folder holds CCCL."""
from __future__ import annotations

from pathlib import Path

import pytest

from megalodon_kernels.cuda import nvrtc


def _resolves(dirs, name: str) -> bool:
    return any((Path(d) / name).exists() for d in dirs)


def _layout(tmp_path: Path, runtime_has_cccl: bool) -> list[Path]:
    """Two nvidia/ folders: the runtime headers in the first, CCCL in the second (or in both)."""
    real = next(d for d in nvrtc._package_dirs("nvidia") if (d / "cu13" / "include" / "cuda_bf16.h").exists())
    real_include = real / "cu13" / "include"
    first = tmp_path / "site" / "nvidia" / "cu13" / "include"
    second = tmp_path / "target" / "nvidia" / "cu13" / "include"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    for entry in real_include.iterdir():
        if entry.name != "cccl" or runtime_has_cccl:
            (first / entry.name).symlink_to(entry)
    (second / "cccl").symlink_to(real_include / "cccl")
    return [tmp_path / "site" / "nvidia", tmp_path / "target" / "nvidia"]


@pytest.mark.parametrize("runtime_has_cccl", [False, True], ids=["cccl-in-target", "cccl-beside-runtime"])
def test_split_header_folders_resolve_both_spellings(tmp_path, monkeypatch, runtime_has_cccl):
    try:
        nvrtc.include_dirs.cache_clear()
        nvrtc.include_dirs()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"no CUDA header wheels here: {exc}")
    finally:
        nvrtc.include_dirs.cache_clear()
    folders = _layout(tmp_path, runtime_has_cccl)
    real_dirs = nvrtc._package_dirs
    monkeypatch.setattr(nvrtc, "_package_dirs", lambda name: folders if name == "nvidia" else real_dirs(name))
    try:
        dirs = nvrtc.include_dirs()
    finally:
        nvrtc.include_dirs.cache_clear()
    print(dirs)
    assert dirs[0] == str(folders[0] / "cu13" / "include")  # the runtime headers (cuda_bf16.h)
    for header in ("cuda_bf16.h", "cuda/std/type_traits", "cccl/cuda/std/type_traits"):
        assert _resolves(dirs, header), f"{header} is not reachable from {dirs}"
