"""Mesh channels reconnect quickly to a peer restarted on the same address: gRPC's default
backoff (to 120 s, shared by every channel to the address through the global subchannel
pool) kept a restarted cachestore unreachable after it was healthy again."""
from __future__ import annotations

import grpc

from services.mesh.mesh_auth import RECONNECT_OPTIONS, MeshSecurity, mesh_channel


def _options_of(monkeypatch, **kwargs) -> dict:
    seen = {}

    def fake(address, options=None, interceptors=None):
        seen.update(dict(options or ()))
        return object()

    monkeypatch.setattr(grpc.aio, "insecure_channel", fake)
    mesh_channel("127.0.0.1:1", security=MeshSecurity(), **kwargs)
    return seen


def test_every_mesh_channel_caps_reconnect_backoff_and_keeps_its_own_subchannels(monkeypatch):
    seen = _options_of(monkeypatch)
    assert seen["grpc.max_reconnect_backoff_ms"] <= 1000
    assert seen["grpc.use_local_subchannel_pool"] == 1
    assert set(dict(RECONNECT_OPTIONS)) <= set(seen)


def test_a_callers_options_win_and_are_kept(monkeypatch):
    seen = _options_of(monkeypatch, options=[("grpc.max_reconnect_backoff_ms", 5000),
                                             ("grpc.max_receive_message_length", 1234)])
    assert seen["grpc.max_reconnect_backoff_ms"] == 5000
    assert seen["grpc.max_receive_message_length"] == 1234
    assert seen["grpc.use_local_subchannel_pool"] == 1

