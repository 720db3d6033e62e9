"""API keys -> tenants (and roles).

The keys file is JSON (``{"sk-abc": "tenant-a", "sk-ops": {"tenant": "ops", "role":
"admin"}}``) or plain lines ``key tenant [role]`` (``#`` comments and blank lines
ignored). A key's role is ``tenant`` (the default) or ``admin``: only an admin key may
read or change the live settings (services/router/admin_routes.py). With keys configured,
a missing or unknown key is rejected; with none configured every caller (with or without
a key) is the ``default`` tenant and nobody is an admin. Keys are compared in constant time.

The store is swapped whole while the router runs (``replace``: SIGHUP, the admin API):
one reference assignment, so a request sees the old table or the new one, never a mix.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from services.mesh.live_settings import KeyEntry, parse_keys
from services.router.errors import AuthenticationError

DEFAULT_TENANT = "default"


class KeyStore:
    """Map of API keys to tenants and roles; the map itself is immutable and replaced whole."""

    def __init__(self, keys: Mapping[str, str | KeyEntry]) -> None:
        self._keys: Mapping[str, KeyEntry] = _entries(keys)

    @classmethod
    def from_file(cls, path: str | Path | None) -> KeyStore:
        """Load a keys file; None or "" gives an open store. Raises ValueError naming the
        file and line (or key) on malformed content."""
        return cls(read_keys_file(path))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def entries(self) -> Mapping[str, KeyEntry]:
        """The table now in force (read-only)."""
        return self._keys

    def replace(self, keys: Mapping[str, str | KeyEntry]) -> None:
        """Swap in a new table (validated first: a bad one raises and changes nothing)."""
        self._keys = _entries(keys)

    def authenticate(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; raises ``AuthenticationError`` when keys are
        configured and the key is missing or unknown."""
        keys = self._keys  # one table for the whole check, even if replaced meanwhile
        if not keys:
            return DEFAULT_TENANT
        entry = _find(keys, api_key)
        return entry.tenant

    def is_admin(self, api_key: str | None) -> bool:
        """Whether ``api_key`` is a known admin key; raises ``AuthenticationError`` when it
        is missing or unknown (an open store has no admins)."""
        keys = self._keys
        if not keys:
            if not api_key:
                raise AuthenticationError("missing API key: the admin API needs an admin key from the keys file")
            return False
        return _find(keys, api_key).role == "admin"


def read_keys_file(path: str | Path | None) -> dict[str, KeyEntry]:
    """key -> entry of a keys file (JSON or ``key tenant [role]`` lines); {} for None or ""."""
    if not path:
        return {}
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        try:
            return parse_keys(value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    keys: dict[str, object] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{path}:{lineno}: expected 'key tenant [role]'")
        keys[parts[0]] = {"tenant": parts[1], "role": parts[2] if len(parts) == 3 else "tenant"}
    try:
        return parse_keys(keys)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _entries(keys: Mapping[str, str | KeyEntry]) -> Mapping[str, KeyEntry]:
    plain = {k: ({"tenant": v.tenant, "role": v.role} if isinstance(v, KeyEntry) else v) for k, v in keys.items()}
    try:
        return MappingProxyType(parse_keys(plain))
    except ValueError as exc:
        raise ValueError(f"invalid API key entry: {exc}") from None


def _find(keys: Mapping[str, KeyEntry], api_key: str | None) -> KeyEntry:
    if not api_key:
        raise AuthenticationError("missing API key (send 'Authorization: Bearer <key>')")
    found = None
    # aiohttp hands undecodable header bytes over as lone surrogates: plain encode()
    # raised on them (an HTTP 500 for "Authorization: Bearer \xff").
    given = api_key.encode("utf-8", "surrogateescape")
    for key, entry in keys.items():
        if hmac.compare_digest(key.encode(), given):
            found = entry
    if found is None:
        raise AuthenticationError("invalid API key")
    return found


def bearer_token(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
