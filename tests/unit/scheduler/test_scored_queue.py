"""One scored queue (issue 17): the policy's order holds for a lone tenant, slots are
shared fairly across tenants, aging serves batch work under an interactive stream, and
the ladder's ``shed`` rung is reachable with one tenant."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.scheduler.api.events import MeshView
from services.scheduler.config import SchedulerConfig
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.dispatch.job import Chunk, Job
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.degradation import DegradationLadder, Rung
from services.scheduler.policy.placement import PlacementPolicy, make_placer
from services.scheduler.policy.priority import PriorityInputs, WeftPrioritizer
from services.scheduler.policy.tenant_limits import TenantAdmission
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorRecord, ExecutorState, Membership
from services.shared.vocabulary import RequestClass, queue_order_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def weft_key(clock: Clock, request_class: RequestClass, attained_tokens: int = 0):
    """The admission key the dispatcher hands for a request arriving now under --policy weft."""
    inputs = PriorityInputs(arrival_s=clock.now, request_class=request_class, attained_tokens=attained_tokens)
    policy = WeftPrioritizer()
    return lambda now: queue_order_key(policy.priority(inputs, now))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0)


def queue(limits: TenantAdmission, tenant: str, key, served: list, name: str) -> asyncio.Task:
    async def wait() -> None:
        await limits.enter(tenant, key)
        served.append(name)
    return asyncio.create_task(wait())


def test_one_tenant_under_load_runs_interactive_and_short_program_hops_before_batch_and_long_programs():
    async def main():
        clock = Clock()
        admission = Admission(max_in_flight=8, max_queue=32)
        admission.clock = clock
        limits = TenantAdmission(admission, max_in_flight_per_tenant=2, max_queue_per_tenant=16)  # below global
        for _ in range(2):
            await limits.enter("t")
        served: list[str] = []
        tasks = [queue(limits, "t", weft_key(clock, RequestClass.BATCH), served, "batch-1"),
                 queue(limits, "t", weft_key(clock, RequestClass.BATCH), served, "batch-2"),
                 queue(limits, "t", weft_key(clock, RequestClass.AGENTIC, 40_000), served, "long-program-hop"),
                 queue(limits, "t", weft_key(clock, RequestClass.AGENTIC, 0), served, "short-program-hop"),
                 queue(limits, "t", weft_key(clock, RequestClass.INTERACTIVE), served, "interactive")]
        await settle()
        assert served == [] and admission.num_queued == 5
        for _ in range(5):
            clock.now += 0.1
            limits.leave("t")
            await settle()
        assert served[:2] == ["interactive", "short-program-hop"]  # the per-tenant FIFO served batch-1 first
        assert set(served[2:]) == {"long-program-hop", "batch-1", "batch-2"}
        assert served.index("batch-1") < served.index("batch-2")  # equal scores: arrival order
        await asyncio.gather(*tasks)
    asyncio.run(main())


def test_two_tenants_share_slots_equally_even_when_one_floods_with_better_scores():
    async def main():
        clock = Clock()
        admission = Admission(max_in_flight=2, max_queue=32)
        admission.clock = clock
        limits = TenantAdmission(admission, max_in_flight_per_tenant=2, max_queue_per_tenant=16)
        for _ in range(2):
            await limits.enter("flood")
        served: list[str] = []
        tasks = [queue(limits, "flood", weft_key(clock, RequestClass.INTERACTIVE), served, "flood")
                 for _ in range(8)]
        tasks += [queue(limits, "quiet", weft_key(clock, RequestClass.BATCH), served, "quiet") for _ in range(3)]
        await settle()
        holders = ["flood", "flood"]
        for _ in range(6):  # the oldest holder finishes; the freed slot goes to whoever is next
            limits.leave(holders.pop(0))
            await settle()
            holders.append(served[-1])
            assert holders.count("quiet") <= 1 and holders.count("flood") <= 1  # one slot each while both wait
        assert served[:6] == ["quiet", "flood"] * 3
        for name in holders:
            limits.leave(name)
        await settle()
        while admission.num_in_flight:
            limits.leave(served[len(served) - admission.num_in_flight])
            await settle()
        await asyncio.gather(*tasks)
        assert admission.num_queued == 0 and limits.num_tenants == 0
    asyncio.run(main())


def test_aging_serves_a_batch_request_under_a_steady_stream_of_interactive_ones():
    async def main():
        clock = Clock()
        admission = Admission(max_in_flight=1, max_queue=8)
        admission.clock = clock
        limits = TenantAdmission(admission, 1, 8)
        await limits.enter("t")
        served: list[str] = []
        batch = queue(limits, "t", weft_key(clock, RequestClass.BATCH), served, "batch")
        tasks = [batch]
        for step in range(1000):  # one interactive request per second, each holding the slot a second
            tasks.append(queue(limits, "t", weft_key(clock, RequestClass.INTERACTIVE), served, f"i{step}"))
            await settle()
            clock.now += 1.0
            limits.leave("t")
            await settle()
            if batch.done():
                break
        assert batch.done(), "the batch request starved"
        assert served[0] == "i0" and served[-1] == "batch"  # interactive first, batch once it has aged
        limits.leave("t")
        await settle()
        while admission.num_in_flight:
            limits.leave("t")
            await settle()
        await asyncio.gather(*tasks)
    asyncio.run(main())


def test_shed_is_reachable_with_one_tenant_under_the_default_caps():
    async def main():
        config = SchedulerConfig()
        membership = Membership()
        membership.heartbeat(ExecutorRecord(name="a", address="a", model_id="m", block_size=4,
                                            state=ExecutorState.SERVING, num_blocks=100, max_num_seqs=4))
        admission = Admission(config.max_in_flight, config.max_queue)
        dispatcher = Dispatcher(SimpleNamespace(membership=membership, kv_index=KvIndex()),
                                make_placer(PlacementPolicy("kv")), admission, port=None,
                                tenant_admission=TenantAdmission(admission, config.max_in_flight_per_tenant,
                                                                 config.max_queue_per_tenant))
        admission.limit_in_flight(dispatcher.executor_slots())  # what generate() does before admission
        ladder = DegradationLadder(config.ladder_config)  # every rung enabled, default thresholds
        tasks, rungs = [], []
        for _ in range(admission.in_flight_cap + config.max_queue):  # one tenant's burst fills the queue
            rungs.append(ladder.observe(RequestClass.INTERACTIVE.value, dispatcher.load_signal()))
            tasks.append(asyncio.create_task(dispatcher.tenant_admission.enter("only")))
            await asyncio.sleep(0)
        assert admission.num_in_flight == 5 and admission.num_queued == config.max_queue
        assert Rung.SHED in rungs  # before: its backlog sat in a per-tenant FIFO the signal never counted
        for task in tasks[5:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(5):
            dispatcher.tenant_admission.leave("only")
        assert admission.num_in_flight == 0 and admission.num_queued == 0
    asyncio.run(main())


class GatedPort:
    """An executor port whose streams each yield one final chunk once ``gate`` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.num_calls = 0

    def generate(self, address, call, timeout_s, traceparent):
        self.num_calls += 1
        port = self

        class Stream:
            def cancel(self) -> None:
                pass

            async def __aiter__(self):
                await port.gate.wait()
                yield Chunk((7,), True, address, num_prompt_tokens=len(call.prompt_token_ids), num_output_tokens=1)
        return Stream()


def test_in_flight_is_bounded_by_the_executors_batch_slots_so_the_backlog_waits_in_the_scored_queue():
    async def main():
        membership = Membership()
        membership.heartbeat(ExecutorRecord(name="a", address="a", model_id="m", block_size=4,
                                            state=ExecutorState.SERVING, num_blocks=100, max_num_seqs=2))
        port, admission = GatedPort(), Admission(max_in_flight=256, max_queue=64)
        dispatcher = Dispatcher(SimpleNamespace(membership=membership, kv_index=KvIndex()),
                                make_placer(PlacementPolicy("kv")), admission, port)
        assert dispatcher.executor_slots() == 3  # 2 slots x 1.25, rounded up

        async def one(i: int) -> list[Chunk]:
            return [c async for c in dispatcher.generate(Job(f"r{i}", [1, 2, 3], "m", "t", max_tokens=1),
                                                         lambda spans: None)]
        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await asyncio.wait_for(until(lambda: port.num_calls >= 3 and admission.num_queued == 3), 10)
        for _ in range(20):
            await asyncio.sleep(0)
        assert port.num_calls == 3 and admission.num_in_flight == 3 and admission.num_queued == 3
        port.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(r[-1].finished for r in results) and port.num_calls == 6 and admission.num_in_flight == 0
    asyncio.run(main())
