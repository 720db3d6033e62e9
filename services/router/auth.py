"""API keys -> tenants.

The keys file is JSON (``{"sk-abc": "tenant-a", ...}``) or plain lines ``key tenant``
(``#`` comments and blank lines ignored). With keys configured, a missing or unknown key
is rejected; with none configured every caller (with or without a key) is the
``default`` tenant. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import json
from pathlib import Path

from services.router.errors import AuthenticationError

DEFAULT_TENANT = "default"


class KeyStore:
    """Immutable map of API keys to tenant names."""

    def __init__(self, keys: dict[str, str]) -> None:
        for key, tenant in keys.items():
            if not key or not tenant or any(c.isspace() for c in key):
                raise ValueError(f"invalid API key entry for tenant {tenant!r}")
        self._keys = dict(keys)

    @classmethod
    def from_file(cls, path: str | Path | None) -> KeyStore:
        """Load a keys file; None or "" gives an open store. Raises ValueError naming the
        file and line on malformed content."""
        if not path:
            return cls({})
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON: {exc}") from None
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ValueError(f"{path}: must map key strings to tenant strings")
            return cls(value)
        keys: dict[str, str] = {}
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'key tenant'")
            keys[parts[0]] = parts[1]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; raises ``AuthenticationError`` when keys are
        configured and the key is missing or unknown."""
        if not self._keys:
            return DEFAULT_TENANT
        if not api_key:
            raise AuthenticationError("missing API key (send 'Authorization: Bearer <key>')")
        tenant = None
        # aiohttp hands undecodable header bytes over as lone surrogates: plain encode()
        # raised on them (an HTTP 500 for "Authorization: Bearer \xff").
        given = api_key.encode("utf-8", "surrogateescape")
        for key, name in self._keys.items():
            if hmac.compare_digest(key.encode(), given):
                tenant = name
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant


def bearer_token(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
