"""Finding a Hugging Face model's ``tokenizer.json``: in the local hub cache, else by a download.

A download needs ``huggingface_hub``, offline mode off and a TCP probe of the hub answered within
:data:`HUB_PROBE_TIMEOUT_S` (so an unreachable hub fails at once). Keeps no state.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["HUB_PROBE_TIMEOUT_S", "cache_dir", "download", "snapshots"]

#: Seconds the hub probe waits for a TCP connection (name resolution included).
HUB_PROBE_TIMEOUT_S = 1.0


def cache_dir() -> Path:
    """The hub cache: ``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``, else under the XDG cache."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def snapshots(repo_id: str, cache: Path) -> list[Path]:
    """The cached snapshots of ``repo_id`` holding a ``tokenizer.json``: the one ``refs/main`` names
    alone when it holds one, else all of them in name order."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    folder = repo_dir / "snapshots"
    if not folder.is_dir():
        return []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (folder / commit / "tokenizer.json").is_file():
            return [folder / commit]
    return sorted(p for p in folder.iterdir() if (p / "tokenizer.json").is_file())


def _offline() -> bool:
    truthy = ("1", "on", "yes", "true")
    if any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub_address() -> tuple[str, int]:
    """``(host, port)`` a download connects to first: the proxy if one is set, else the hub."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    endpoint = os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co"
    url = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    host = url.hostname or "huggingface.co"
    proxy = getproxies().get(url.scheme) or getproxies().get("all")
    if proxy and not proxy_bypass(host):
        purl = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if purl.hostname:
            return purl.hostname, purl.port or (443 if purl.scheme == "https" else 80)
    return host, url.port or (443 if url.scheme == "https" else 80)


def _hub_unreachable() -> str:
    """``""`` when a TCP connection to :func:`_hub_address` opens in time, else why not (in a daemon
    thread: name resolution ignores socket timeouts)."""
    import socket

    host, port = _hub_address()
    outcome: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append("")
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=probe, name="zephon-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.25)
    if not outcome:
        return f"no connection to {host}:{port} within {HUB_PROBE_TIMEOUT_S:g} s"
    return f"no connection to {host}:{port} ({outcome[0]})" if outcome[0] else ""


def download(repo_id: str, cache: Path) -> tuple[Path | None, str]:
    """``(folder, "")`` of ``repo_id``'s ``tokenizer.json`` (and configs) downloaded into ``cache``,
    or ``(None, why not)``."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, "huggingface_hub is not installed"
    if _offline():
        return None, "offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)"
    if unreachable := _hub_unreachable():
        return None, f"{unreachable}; HF_HUB_OFFLINE=1 skips the probe"
    try:
        file = Path(hf_hub_download(repo_id, "tokenizer.json", cache_dir=str(cache)))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"the download failed ({type(exc).__name__}: {first}; HF_HUB_OFFLINE=1 skips the attempt)"
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        with contextlib.suppress(Exception):  # optional files; absent for many models
            hf_hub_download(repo_id, extra, cache_dir=str(cache))
    return file.parent, ""
