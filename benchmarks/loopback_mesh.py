"""What load.py and soak.py share: a loopback mesh started with the launcher (`weft up`'s
code), an API-keys file for several tenants, and one streaming OpenAI completion over SSE.

Loopback only: the mesh binds 127.0.0.1, and a URL given to drive an existing mesh must
point at 127.0.0.1 / localhost (``require_loopback``).
"""
from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def require_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise SystemExit(f"refusing to send load to {host!r}: loopback only ({', '.join(LOOPBACK_HOSTS)})")
    return url


def tenant_keys(num_tenants: int) -> dict[str, str]:
    """API key → tenant."""
    return {f"sk-load-{i}": f"tenant-{i}" for i in range(num_tenants)}


@asynccontextmanager
async def loopback_mesh(state_dir: Path, model_dir: Path | None, num_executors: int, keys: dict[str, str],
                        extra_env: dict[str, str] | None = None):
    """Start NATS + one of each service (``num_executors`` executors) on free loopback
    ports; yields the launcher's MeshState; stops everything on exit."""
    from weft.launcher.launcher import Launcher, UpOptions

    state_dir.mkdir(parents=True, exist_ok=True)
    keys_file = state_dir / "keys.json"
    keys_file.write_text(json.dumps(keys))
    launcher = Launcher(UpOptions(model_dir=str(model_dir) if model_dir else None, num_executors=num_executors,
                                  http_port=0, grpc_port=0, state_dir=state_dir, keys_file=str(keys_file),
                                  log_level="warning", extra_env=dict(extra_env or {})))
    try:
        yield await launcher.start()
    finally:
        await launcher.stop()


@dataclass(frozen=True)
class StreamResult:
    ok: bool
    num_tokens: int
    ttft_s: float | None
    total_s: float
    error: str = ""


async def served_model(session: aiohttp.ClientSession, http_url: str, api_key: str) -> str:
    async with session.get(f"{http_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def stream_completion(session: aiohttp.ClientSession, http_url: str, api_key: str, model: str, prompt: str,
                            max_tokens: int, timeout_s: float) -> StreamResult:
    """One streaming /v1/completions call; never raises (errors are results)."""
    t0 = time.monotonic()
    ttft, num_tokens = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    try:
        async with session.post(f"{http_url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {api_key}"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:200]
                return StreamResult(False, 0, None, time.monotonic() - t0, f"HTTP {resp.status}: {detail}")
            finished = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return StreamResult(False, num_tokens, ttft, time.monotonic() - t0, "stream error")
                for choice in event.get("choices", ()):
                    n = len(choice.get("token_ids") or ())
                    if n and ttft is None:
                        ttft = time.monotonic() - t0
                    num_tokens += n
                    finished = finished or choice.get("finish_reason") is not None
            ok = finished and num_tokens == max_tokens
            return StreamResult(ok, num_tokens, ttft, time.monotonic() - t0, "" if ok else "short stream")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(False, num_tokens, ttft, time.monotonic() - t0, type(exc).__name__)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
