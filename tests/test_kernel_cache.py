"""The C kernels load even where their cache folder cannot be written (read-only home, permission
denied): they are built in a temporary folder instead of leaving decode to the slow PyTorch ops.
The mechanism is tested on a one-function source (the kernels' own file takes a minute or more to
compile at -O3; every other test loads that one from the cache)."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

from fasterllama.backends.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="C kernels cannot be built here")


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """A source with one function, and a private temporary folder (to see that nothing is left)."""
    source = tmp_path / "tiny.c"
    source.write_text("long fl_tiny(long a) { return 3 * a + 1; }\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return source


def _build_with_cache(cache, source, monkeypatch, caplog):
    monkeypatch.setenv("FASTERLLAMA_CACHE", str(cache))
    with caplog.at_level(logging.WARNING, logger=kernels.log.name):
        lib = kernels._build_and_open(source)
    assert lib.fl_tiny(14) == 43
    assert not os.listdir(tempfile.tempdir)  # the temporary build is gone once loaded
    return lib


def test_cache_path_blocked_by_a_file(tmp_path, tiny_source, monkeypatch, caplog):
    """A cache that cannot be created, whoever runs (also root): a file stands where a folder must."""
    (tmp_path / "file").write_text("")
    _build_with_cache(tmp_path / "file" / "cache", tiny_source, monkeypatch, caplog)
    assert "not writable" in caplog.text


def test_read_only_cache(tmp_path, tiny_source, monkeypatch, caplog):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        _build_with_cache(cache, tiny_source, monkeypatch, caplog)
        assert "not writable" in caplog.text
        assert not list(cache.iterdir())
    finally:
        cache.chmod(0o700)


def test_writable_cache_keeps_the_library(tmp_path, tiny_source, monkeypatch, caplog):
    """Built once into the cache, then found there (the build key names the file)."""
    cache = tmp_path / "cache"
    _build_with_cache(cache, tiny_source, monkeypatch, caplog)
    (built,) = cache.glob("*.so")
    stamp = built.stat().st_mtime_ns
    assert caplog.text.count("building the C kernels") == 1  # (said: the real build takes a minute)
    _build_with_cache(cache, tiny_source, monkeypatch, caplog)
    assert list(cache.glob("*.so")) == [built] and built.stat().st_mtime_ns == stamp  # not built again
    assert "not writable" not in caplog.text and caplog.text.count("building the C kernels") == 1


def test_builders_starting_together_build_once(tmp_path, tiny_source, monkeypatch):
    """Processes starting at once (pytest-xdist workers, tensor-parallel ranks) wait for one build
    of the library (each compiled its own: a minute of both cores at a fresh CI's start)."""
    import threading
    import time

    monkeypatch.setenv("FASTERLLAMA_CACHE", str(tmp_path / "cache"))
    real_compile, builds = kernels._compile, []

    def slow_compile(*args):
        builds.append(1)
        time.sleep(0.5)  # (the others arrive while it builds)
        real_compile(*args)

    monkeypatch.setattr(kernels, "_compile", slow_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(kernels._build_and_open(tiny_source).fl_tiny(2))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [7, 7, 7] and len(builds) == 1
