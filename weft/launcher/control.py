"""The launcher's loopback control endpoint, and its clients (``weft scale``, ``weft chaos``).

    POST /scale  {"service": "executor", "replicas": N}  -> {"executors": [...]}
    GET  /state                                          -> the mesh state
    POST /chaos  {"action": "kill|pause|resume|restart", "name": "executor-1"} (weft/launcher/chaos.py)

Bound to the launcher's host (loopback) on a free port; every call must carry the
random token recorded in the 0600 state file (``x-weft-control-token``). The endpoint is
handed a ``ControlTarget`` (the launcher) and imports none of it: it is HTTP in front of
three methods.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import asdict
from typing import Protocol

import aiohttp
from aiohttp import web

from weft.launcher.mesh_state import MeshState

TOKEN_HEADER = "x-weft-control-token"


class ControlTarget(Protocol):
    """What the control endpoint serves: the launcher, seen through three calls."""

    control_token: str  # callers must present it (TOKEN_HEADER)

    def state(self) -> MeshState:
        """The mesh as the state file records it; does not change anything."""

    async def scale(self, service: str, replicas: int) -> list[str]:
        """Start or drain instances of ``service``; ValueError on a bad request."""

    async def chaos(self, action: str, name: str) -> dict:
        """Kill, pause, resume or restart instance ``name``; ValueError on a bad request."""


async def start_control_server(target: ControlTarget, host: str) -> tuple[web.AppRunner, int]:
    @web.middleware
    async def check_token(request: web.Request, handler):
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), target.control_token.encode()):
            return web.json_response({"error": "bad control token"}, status=403)
        return await handler(request)

    async def scale(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            service, replicas = body["service"], body["replicas"]
            if not isinstance(replicas, int) or isinstance(replicas, bool):
                raise ValueError("replicas must be an integer")
            names = await target.scale(service, replicas)
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # MeshStartError and friends: tell the caller why
            return web.json_response({"error": str(exc)}, status=500)
        return web.json_response({"executors": names})

    async def chaos(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            result = await target.chaos(body["action"], body["name"])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # a restart that failed: tell the caller why
            return web.json_response({"error": str(exc)}, status=500)
        return web.json_response(result)

    async def state(_request: web.Request) -> web.Response:
        return web.json_response(asdict(target.state()))

    app = web.Application(middlewares=[check_token])
    app.router.add_post("/scale", scale)
    app.router.add_get("/state", state)
    app.router.add_post("/chaos", chaos)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def _post(state: MeshState, path: str, body: dict, timeout_s: float) -> dict:
    """POST ``body`` to the running launcher's control endpoint; RuntimeError with its reason."""
    url = f"http://127.0.0.1:{state.control_port}{path}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, json=body, headers={TOKEN_HEADER: state.control_token}) as resp:
            reply = await resp.json()
            if resp.status != 200:
                raise RuntimeError(reply.get("error", f"HTTP {resp.status}"))
            return reply


async def request_scale(state: MeshState, service: str, replicas: int, timeout_s: float = 300.0) -> list[str]:
    """Ask the running launcher to scale; raises RuntimeError with its error message."""
    reply = await _post(state, "/scale", {"service": service, "replicas": replicas}, timeout_s)
    return reply["executors"]


async def request_chaos(state: MeshState, action: str, name: str, timeout_s: float = 300.0) -> dict:
    """Ask the running launcher to do ``action`` to ``name``; RuntimeError with its reason."""
    return await _post(state, "/chaos", {"action": action, "name": name}, timeout_s)
