"""pagedllm.utils.atomic.atomic_path: the shared temp-file-and-rename writer of the caches (assembled model files,
built kernels, xgrammar tokenizer info)."""

import os
import stat

import pytest

from pagedllm.utils.atomic import atomic_path


def test_whole_file_replaces_the_target_with_shared_permissions(tmp_path):
    target = tmp_path / "sub" / "file.bin"  # the folder is made
    with atomic_path(str(target)) as tmp:
        assert os.path.dirname(tmp) == str(target.parent) and not target.exists()
        with open(tmp, "wb") as f:
            f.write(b"new")
    assert target.read_bytes() == b"new"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert os.listdir(target.parent) == ["file.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_path(str(target), suffix=".so") as tmp:
            assert tmp.endswith(".so")
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("midway")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]


def test_unshared_keeps_the_writers_mode(tmp_path):
    target = tmp_path / "lib.so"
    with atomic_path(str(target), shared=False) as tmp:
        os.chmod(tmp, 0o700)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
