import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "zephon-cache"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache folder of the test's own, for tests that look at what is cached."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(folder))
    return folder
