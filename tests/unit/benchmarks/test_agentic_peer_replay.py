"""The peer benchmark's closed-loop driver against a fake engine: whole-context prompts,
at most `concurrency` programs at once, hints only for the hinted configurations, and a
deadline that counts what it cuts off instead of hanging."""
from __future__ import annotations

import asyncio

from benchmarks import agentic_peer_report as rep
from benchmarks.agentic_peer import replay
from benchmarks.agentic_workload import PeerWorkloadSpec, make_peer_workload

SPEC = PeerWorkloadSpec(num_programs=6, concurrency=2, tool_median_s=0.0, interactive_rate_per_s=0.0,
                        output_tokens=3)


class FakeEngine:
    def __init__(self, block_prefix: str = "") -> None:
        self.calls = []  # (request id, prompt, hints)
        self.in_flight = self.max_in_flight = 0
        self.block_prefix = block_prefix  # requests whose id starts with it never answer
        self.never = asyncio.Event()
        self.ended = []  # session ids, in the order ended

    async def end_session(self, session_id):
        self.ended.append(session_id)

    async def generate(self, rid, prompt, max_tokens, hints, on_first=None):
        self.calls.append((rid, list(prompt), hints))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # lets the other programs interleave
            if self.block_prefix and rid.startswith(self.block_prefix):
                await self.never.wait()
            if on_first is not None:
                on_first(0.001)
            return 0.001, [7] * max_tokens
        finally:
            self.in_flight -= 1


def test_every_hop_sends_the_whole_context_and_programs_run_two_at_a_time():
    programs, chats = make_peer_workload(SPEC, 0, 1000, 4000)
    engine = FakeEngine()
    s = asyncio.run(replay(engine, rep.HINTS, "t", programs, chats, SPEC, deadline_s=60))
    assert s.num_programs == 6 and s.num_censored == 0 and s.num_errors == 0
    assert engine.max_in_flight == 2
    p = programs[0]
    prompts = [prompt for rid, prompt, _ in engine.calls if rid.startswith("t-prog-0-")]
    context = list(p.prefix_token_ids)
    for hop, prompt in zip(p.hops, prompts, strict=True):
        context += hop.new_token_ids
        assert prompt == context
        context += [7] * SPEC.output_tokens
    hints = [h for rid, _, h in engine.calls if rid.startswith("t-prog-0-")]
    assert [h.hop_index for h in hints] == list(range(len(p.hops)))
    assert all(h.request_class == "agentic" and h.session_id == "t-prog-0" for h in hints)
    assert sorted(engine.ended) == sorted(f"t-{p.program_id}" for p in programs)  # each once, when it is done


def test_the_no_hints_configuration_sends_no_hints():
    programs, chats = make_peer_workload(SPEC, 0, 1000, 4000)
    engine = FakeEngine()
    asyncio.run(replay(engine, rep.NO_HINTS, "t", programs, chats, SPEC, deadline_s=60))
    assert engine.calls and all(h is None for _, _, h in engine.calls)
    assert engine.ended == []


def test_the_deadline_cuts_off_a_hung_program_and_counts_it():
    programs, chats = make_peer_workload(SPEC, 0, 1000, 4000)
    engine = FakeEngine(block_prefix="t-prog-1-")
    s = asyncio.run(replay(engine, rep.HINTS, "t", programs, chats, SPEC, deadline_s=0.5))
    assert s.num_censored == 1  # prog-1 hung; its worker took no other program, the other worker ran the rest
    assert s.num_programs == 6  # five finished + the cut-off one at its time so far
