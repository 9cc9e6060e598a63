"""The C kernels load even where their cache folder cannot be written (read-only home, permission
denied): they are built in a temporary folder instead of leaving decode to the slow PyTorch ops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fasterllama.backends.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="C kernels cannot be built here")


def _loads_with_cache(cache) -> subprocess.CompletedProcess:
    code = "from fasterllama.backends.cpu import kernels; assert kernels.load() is not None"
    env = {**os.environ, "FASTERLLAMA_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600)


def test_read_only_cache(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        proc = _loads_with_cache(cache)
        assert proc.returncode == 0, proc.stderr
        assert "not writable" in proc.stderr
        assert not list(cache.iterdir())
    finally:
        cache.chmod(0o700)


def test_cache_path_blocked_by_a_file(tmp_path):
    """A cache that cannot be created, whoever runs (also root): a file stands where a folder must."""
    (tmp_path / "file").write_text("")
    proc = _loads_with_cache(tmp_path / "file" / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "not writable" in proc.stderr
