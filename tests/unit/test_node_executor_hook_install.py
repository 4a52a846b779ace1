"""The node-executor puts the CUDA hook on the node by an atomic rename: a process that has the
old library mapped keeps it intact, and the directory never holds a partial file."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from gpupool.node_executor.hook_install import install_cuda_hook


def test_the_library_replaces_the_old_one_without_touching_its_mapped_contents(
    tmp_path: Path,
) -> None:
    built, host = tmp_path / "image" / "libgpupool-cuda-hook.so", tmp_path / "host"
    built.parent.mkdir()
    built.write_bytes(b"old library")
    installed = install_cuda_hook(built, host)
    assert installed == host / "libgpupool-cuda-hook.so"
    with open(installed, "rb") as mapped_file:
        mapped = mmap.mmap(mapped_file.fileno(), 0, access=mmap.ACCESS_READ)
        built.write_bytes(b"new library, longer")
        assert install_cuda_hook(built, host) == installed
        assert mapped[:] == b"old library"  # a running process's mapping is the old file
        mapped.close()
    assert installed.read_bytes() == b"new library, longer"
    assert oct(installed.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in host.iterdir()) == ["libgpupool-cuda-hook.so"]


def test_a_missing_library_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        install_cuda_hook(tmp_path / "missing.so", tmp_path / "host")
    assert not (tmp_path / "host").exists()
