"""The launcher's loopback control endpoint, and its client used by ``weft scale``.

    POST /scale  {"service": "executor", "replicas": N}  -> {"executors": [...]}
    GET  /state                                          -> the mesh state
    POST /chaos  {"action": "kill|pause|resume|restart", "name": "executor-1"} (weft/chaos.py)

Bound to the launcher's host (loopback) on a free port; every call must carry the
random token recorded in the 0600 state file (``x-weft-control-token``).
"""
from __future__ import annotations

import hmac
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from weft.mesh_state import MeshState

if TYPE_CHECKING:
    from weft.launcher import Launcher

TOKEN_HEADER = "x-weft-control-token"


async def start_control_server(launcher: Launcher, host: str) -> tuple[web.AppRunner, int]:
    @web.middleware
    async def check_token(request: web.Request, handler):
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), launcher.control_token.encode()):
            return web.json_response({"error": "bad control token"}, status=403)
        return await handler(request)

    async def scale(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            service, replicas = body["service"], body["replicas"]
            if not isinstance(replicas, int) or isinstance(replicas, bool):
                raise ValueError("replicas must be an integer")
            names = await launcher.scale(service, replicas)
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # MeshStartError and friends: tell the caller why
            return web.json_response({"error": str(exc)}, status=500)
        return web.json_response({"executors": names})

    async def chaos(request: web.Request) -> web.Response:
        from weft.chaos import apply_chaos

        try:
            body = await request.json()
            result = await apply_chaos(launcher, body["action"], body["name"])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # a restart that failed: tell the caller why
            return web.json_response({"error": str(exc)}, status=500)
        return web.json_response(result)

    async def state(_request: web.Request) -> web.Response:
        return web.json_response(asdict(launcher.state()))

    app = web.Application(middlewares=[check_token])
    app.router.add_post("/scale", scale)
    app.router.add_get("/state", state)
    app.router.add_post("/chaos", chaos)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def request_scale(state: MeshState, service: str, replicas: int, timeout_s: float = 300.0) -> list[str]:
    """Ask the running launcher to scale; raises RuntimeError with its error message."""
    url = f"http://127.0.0.1:{state.control_port}/scale"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, json={"service": service, "replicas": replicas},
                                headers={TOKEN_HEADER: state.control_token}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(body.get("error", f"HTTP {resp.status}"))
            return body["executors"]
