"""Metadata stores: the shared, live view of pools and bindings.

Two implementations of :class:`rollart_nb.protocols.MetadataStore`:

- :class:`GcsStore` (default): Ray's GCS key-value store; no extra service.
- :class:`RedisStore`: a Redis server given by URL (``redis://127.0.0.1:6379/0``).

Values are JSON objects. Keys are namespaced by a prefix: one per session for its own records,
and ``""`` for the records every session of a cluster reads (which session holds which pool
slots, see :class:`~rollart_nb.resources.manager.ResourceManager`). :meth:`put_new` writes a key
only if it is absent, which is what a cluster-wide lock needs.
"""

from __future__ import annotations

import json
from typing import Any

import rollart_nb._ray as _ray
from rollart_nb.errors import ConfigError, StoreError

__all__ = ["GcsStore", "MemoryStore", "RedisStore", "make_store"]


class MemoryStore:
    """An in-process dict (for the ``sim`` backend and unit tests; not shared across processes)."""

    kind = "memory"

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._d: dict[str, str] = {}

    def put(self, key: str, value: dict[str, Any]) -> None:
        self._d[self.prefix + key] = json.dumps(value)

    def put_new(self, key: str, value: dict[str, Any]) -> bool:
        """Write ``key`` only if it is absent; True if written."""
        if self.prefix + key in self._d:
            return False
        self._d[self.prefix + key] = json.dumps(value)
        return True

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self._d.get(self.prefix + key)
        return None if raw is None else json.loads(raw)

    def delete(self, key: str) -> None:
        self._d.pop(self.prefix + key, None)

    def keys(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return sorted(k[n:] for k in self._d if k.startswith(self.prefix + prefix))

    def clear(self) -> None:
        for k in self.keys():
            self.delete(k)


class GcsStore:
    """Ray GCS key-value store (needs an initialized Ray connection).

    Example:
        >>> store = GcsStore(prefix="sess1/")     # doctest: +SKIP
        >>> store.put("pools/H800", {"slots": 8})  # doctest: +SKIP
    """

    kind = "gcs"

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def put(self, key: str, value: dict[str, Any]) -> None:
        try:
            _ray.kv_put(self.prefix + key, json.dumps(value).encode())
        except Exception as e:
            raise StoreError(f"GCS store put {key!r} failed: {e}; is the Session still attached?") from e

    def put_new(self, key: str, value: dict[str, Any]) -> bool:
        """Write ``key`` only if it is absent (atomic in the GCS); True if written."""
        try:
            return _ray.kv_put(self.prefix + key, json.dumps(value).encode(), overwrite=False)
        except Exception as e:
            raise StoreError(f"GCS store put {key!r} failed: {e}; is the Session still attached?") from e

    def get(self, key: str) -> dict[str, Any] | None:
        raw = _ray.kv_get(self.prefix + key)
        return None if raw is None else json.loads(raw)

    def delete(self, key: str) -> None:
        _ray.kv_del(self.prefix + key)

    def keys(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in _ray.kv_keys(self.prefix + prefix)]

    def clear(self) -> None:
        for k in self.keys():
            self.delete(k)

    def __repr__(self) -> str:
        return f"GcsStore(prefix={self.prefix!r})"


class RedisStore:
    """A Redis server as the metadata store (the paper's choice at scale).

    Args:
        url: ``redis://host:port/db``; the password, if any, is never shown in reprs or logs.
        prefix: key namespace.
        timeout_s: connect / command timeout.
    """

    kind = "redis"

    def __init__(self, url: str, prefix: str = "", timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError as e:
            raise ConfigError("a redis:// store needs the redis extra: pip install 'rollart_nb[redis]'") from e
        self.prefix = prefix
        self._url = url
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            self._r.ping()
        except Exception as e:
            raise StoreError(
                f"cannot reach Redis at {self.safe_url}: {type(e).__name__}; start redis-server or fix the URL"
            ) from None

    @property
    def safe_url(self) -> str:
        """The URL with any password masked."""
        from urllib.parse import urlsplit

        u = urlsplit(self._url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
        auth = "***@" if u.password else ""
        return f"{u.scheme}://{auth}{host}{port}{u.path}"

    def put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self._r.set(self.prefix + key, json.dumps(value))
        except Exception as e:
            raise StoreError(f"Redis put {key!r} at {self.safe_url} failed: {type(e).__name__}") from None

    def put_new(self, key: str, value: dict[str, Any]) -> bool:
        """Write ``key`` only if it is absent (Redis ``SET NX``); True if written."""
        try:
            return bool(self._r.set(self.prefix + key, json.dumps(value), nx=True))
        except Exception as e:
            raise StoreError(f"Redis put {key!r} at {self.safe_url} failed: {type(e).__name__}") from None

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self._r.get(self.prefix + key)
        return None if raw is None else json.loads(raw)

    def delete(self, key: str) -> None:
        self._r.delete(self.prefix + key)

    def keys(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        pat = (self.prefix + prefix).replace("*", r"\*") + "*"
        return sorted(k.decode()[n:] for k in self._r.scan_iter(match=pat))

    def clear(self) -> None:
        for k in self.keys():
            self.delete(k)

    def __repr__(self) -> str:
        return f"RedisStore({self.safe_url!r}, prefix={self.prefix!r})"


def make_store(url: str | None, prefix: str) -> GcsStore | RedisStore | MemoryStore:
    """``None`` or ``"gcs"`` -> GcsStore; ``redis://...`` -> RedisStore; ``"memory"`` -> MemoryStore."""
    if url in (None, "", "gcs"):
        return GcsStore(prefix)
    if url == "memory":
        return MemoryStore(prefix)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, prefix)
    raise ConfigError(f"unknown metadata store {url!r}; use None (Ray GCS) or a redis://host:port URL")
