"""The mesh-overhead benchmark's transport floor (benchmarks/grpc_floor.py): a chain of
real grpc.aio processes on loopback that relays every message, survives a client that
hangs up mid-stream, and leaves no process behind; and the report's floor table."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from benchmarks import mesh_overhead_report as mesh_overhead
from benchmarks import grpc_floor
from benchmarks.grpc_floor import METHOD, FloorChain, FloorClient, _request, _same, parse_args


def test_a_three_hop_chain_relays_every_message_in_order_and_survives_a_client_that_hangs_up():
    chain = FloorChain(3)
    procs = list(chain.procs)
    try:
        async def main():
            client = FloorClient(chain.address)
            try:
                _, arrivals, total = await client.run(32, 30.0)
                times = [t for t, _ in arrivals]
                assert total == 32 and times == sorted(times)
                call = client.channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)
                stream = call(_request(100_000), timeout=30.0)
                async for _ in stream:  # hang up after the first message
                    break
                stream.cancel()
                _, _, total = await client.run(5, 30.0)  # every hop still serves
                assert total == 5
            finally:
                await client.close()

        asyncio.run(asyncio.wait_for(main(), 60))
        assert all(p.poll() is None for p in procs)
    finally:
        chain.stop()
    assert all(p.poll() is not None for p in procs)  # stop() ends (and reaps) every hop


def test_a_chain_of_no_hops_is_refused():
    with pytest.raises(ValueError, match="hops"):
        FloorChain(0)


def test_the_measure_command_refuses_nonsense_counts():
    with pytest.raises(SystemExit):
        parse_args(["--hops", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--messages", "0"])


def test_a_call_to_a_stopped_chain_fails_as_unavailable():
    chain = FloorChain(1)
    chain.stop()

    async def main():
        client = FloorClient(chain.address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.run(1, 5.0)
            return err.value.code()
        finally:
            await client.close()

    assert asyncio.run(main()) is grpc.StatusCode.UNAVAILABLE


def _timings(ttft_ms: float) -> mesh_overhead.Timings:
    t = mesh_overhead.Timings()
    t.add(0.0, [(ttft_ms / 1000, 1), (ttft_ms / 1000 + 0.001, 1)])
    return t


def test_the_report_splits_the_added_ttft_into_the_floor_and_weft_s_own_work():
    rounds = [{16: {"in-process": _timings(2.0), "mesh gRPC": _timings(7.0), "mesh HTTP": _timings(7.5),
                    mesh_overhead.FLOOR: _timings(2.5)}} for _ in range(3)]
    table = mesh_overhead.against_floor(rounds)
    assert "| 16 | mesh gRPC | +5.00 (+5.00–+5.00) | 2.50 (2.50–2.50) | +2.50 (+2.50–+2.50) |" in table
    assert "| 16 | mesh HTTP | +5.50 (+5.50–+5.50) | 2.50 (2.50–2.50) | +3.00 (+3.00–+3.00) |" in table


@pytest.mark.parametrize("links", [("call", "mux", "mux"), ("mux", "mux", "mux"), ("mux", "call", "mux")])
def test_multiplexed_links_give_each_of_many_concurrent_requests_exactly_its_own_messages(links):
    chain = FloorChain(3, links=links)
    try:
        async def main():
            client = FloorClient(chain.address, links[0])
            try:
                counts = [1 + (7 * i) % 23 for i in range(24)]
                results = await asyncio.gather(*(client.run(n, 30.0) for n in counts))
                assert [total for _, _, total in results] == counts
                if client.mux is not None:  # a request left early is cancelled; the link serves on
                    stream = client.mux.stream(100_000)
                    assert await anext(stream) == grpc_floor.MESSAGE
                    await stream.aclose()
                assert (await client.run(5, 30.0))[2] == 5
            finally:
                await client.close()

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        chain.stop()


def test_a_mux_link_whose_peer_died_fails_its_requests_instead_of_hanging():
    chain = FloorChain(1)
    try:
        async def main():
            client = FloorClient(chain.address, "mux")
            try:
                assert (await client.run(3, 30.0))[2] == 3
                chain.stop()
                with pytest.raises((RuntimeError, grpc.aio.AioRpcError)):
                    await client.run(3, 30.0)
            finally:
                await client.close()

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        chain.stop()


def test_links_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="links"):
        FloorChain(2, links=("call",))
    with pytest.raises(ValueError, match="links"):
        FloorChain(1, links=("carrier-pigeon",))
    with pytest.raises(ValueError, match="link"):
        FloorClient("127.0.0.1:1", "udp")
    for bad in (["--links", "call,udp"], ["--links", "call", "--links", "call"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    args = parse_args(["--hops", "2"])
    assert args.chains == [("call", "call")]
    assert parse_args(["--links", "call,mux,mux", "--links", "mux"]).chains == [("call", "mux", "mux"), ("mux",)]


def test_the_floor_report_compares_each_chain_with_the_first_in_the_same_round():
    args = parse_args(["--links", "call,call", "--links", "call,mux", "--rounds", "2", "--requests", "3"])
    results = {("call", "call"): [[2.0, 2.0, 2.0], [4.0, 4.0, 4.0]], ("call", "mux"): [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]}
    text = grpc_floor.report(args, results)
    assert "| call → call | 3.00 (2.00–4.00) | 4.00 | — |" in text
    assert "| call → mux | 1.00 (1.00–1.00) | 1.00 | 3.00× (2.00–4.00) |" in text
