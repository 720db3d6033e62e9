"""Slow clients against a real router process (issue 12 §4): a connection whose headers
never finish, whose body never completes, or which never sends a request at all used to
be held open indefinitely (aiohttp's defaults: an hour for the first, forever for the
body), one file descriptor each, until the router ran out of them for everyone. Now each
is closed after the router's idle / body timeouts while /health keeps answering."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import pytest

from services.mesh.nats_server import free_port
from tests.adversarial.test_hostile_http import start_router
from tests.integration.conftest import ServiceProcess

DEADLINE_S = 60.0  # a bound on the wait, far above the timeouts below; not a measurement
PARTIAL = {
    "no request": b"",
    "headers never finished": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "body never completed": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\nContent-Length: 100\r\n\r\n{",
    "chunked body with no last chunk": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
}


@pytest.fixture(scope="module")
def impatient_router(tmp_path_factory, tiny_model_dir) -> Iterator[ServiceProcess]:
    router = start_router(tmp_path_factory.mktemp("router"), tiny_model_dir, f"127.0.0.1:{free_port()}",
                          "--http-idle-timeout-s", "1", "--body-read-timeout-s", "1")
    try:
        yield router
    finally:
        router.stop()


async def _closed_by_server(port: int, partial: bytes) -> bytes:
    """Send ``partial`` and read until the server closes the connection; returns what it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(partial)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), DEADLINE_S)
    finally:
        writer.close()


@pytest.mark.parametrize("what", list(PARTIAL))
def test_a_slow_client_is_disconnected_and_health_keeps_answering(impatient_router, what):
    port = int(impatient_router.http.rsplit(":", 1)[1])

    async def go():
        many = [_closed_by_server(port, PARTIAL[what]) for _ in range(50)]
        return await asyncio.gather(*many)

    answers = asyncio.run(go())
    if what.startswith(("body", "chunked")):
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
    with urllib.request.urlopen(f"{impatient_router.http}/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
