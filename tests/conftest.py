import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "zephon-cache"))
