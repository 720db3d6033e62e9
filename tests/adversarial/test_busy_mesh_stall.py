"""A busy but healthy mesh is not a stalled one (issue 12: under 200 concurrent streams,
10-15 % got 503 "no chunk for 5.0 s and no answer to a health probe" while the scheduler
was alive). The streams queued behind each other all reached the router's first-chunk
ceiling at once, each probed the scheduler's health, and the herd of probes on a
scheduler busy relaying everyone else's tokens went unanswered within the probe timeout.

Here 200 streams start together on a real ``weft up`` mesh (two executors, the tiny
model) and every one must complete: HTTP 200, no error event, every requested token, and
the router never gave up on its scheduler. The probe timeout is set to a quarter second
(an operator's choice the router accepts) so the fault shows on a fast machine too; the
fixed router needs no probe answer while other streams' chunks flow.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.integration.launched_mesh import launched_mesh

NUM_STREAMS = 200
MAX_TOKENS = 200
ENV = {"WEFT_ROUTER_CONTINUATION_PROBE_TIMEOUT_S": "0.25"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("busy-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 2, ENV, timeout_s=120, check_orphans=False) as (_, state):
        yield state


async def stream_one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, list[dict], str]:
    """(status, the stream's JSON events, the raw body)."""
    body = {"model": "tiny", "prompt": f"stream {i} " * (5 + i % 60), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        raw = await resp.text()
    events = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return resp.status, events, raw


async def storm(url: str) -> list[tuple[int, list[dict], str]]:
    # A bound, not a threshold: a hang fails the test instead of blocking the suite.
    timeout = aiohttp.ClientTimeout(total=240)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(stream_one(session, url, i) for i in range(NUM_STREAMS)))


def test_200_concurrent_streams_on_a_healthy_mesh_get_no_503_and_complete(mesh):
    results = asyncio.run(storm(mesh.http_url))
    refused = [(status, raw[:300]) for status, _, raw in results if status != 200]
    assert not refused, f"{len(refused)} of {NUM_STREAMS} streams refused, e.g. {refused[:3]}"
    failed = [raw[-300:] for _, events, raw in results if any("error" in e for e in events)]
    assert not failed, f"{len(failed)} of {NUM_STREAMS} streams ended with an error event, e.g. {failed[:3]}"
    assert all(raw.rstrip().endswith("data: [DONE]") for _, _, raw in results)
    usage = [next(e["usage"] for e in events if e.get("usage")) for _, events, _ in results]
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usage)
