"""API keys -> tenants."""
from __future__ import annotations

import pytest

from services.router.auth import DEFAULT_TENANT, KeyStore, bearer_token
from services.router.errors import AuthenticationError


def test_without_keys_any_caller_is_the_default_tenant():
    store = KeyStore.from_file(None)
    assert store.authenticate(None) == DEFAULT_TENANT
    assert store.authenticate("whatever") == DEFAULT_TENANT


def test_json_keys_file_maps_keys_to_tenants(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"sk-a": "alpha", "sk-b": "beta"}')
    store = KeyStore.from_file(path)
    assert store.authenticate("sk-b") == "beta"
    with pytest.raises(AuthenticationError):
        store.authenticate("sk-c")
    with pytest.raises(AuthenticationError):
        store.authenticate(None)


def test_line_keys_file_with_comments(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nsk-a alpha\n\nsk-b beta  # second\n")
    assert KeyStore.from_file(path).authenticate("sk-a") == "alpha"


def test_malformed_line_names_the_line(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("sk-a alpha\nsk-b\n")
    with pytest.raises(ValueError, match=":2:"):
        KeyStore.from_file(path)


def test_bearer_token_parsing():
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token("bearer  sk-1 ") == "sk-1"
    assert bearer_token("Basic abc") is None
    assert bearer_token(None) is None
