"""Agentic benchmark workloads: agent programs (long-tailed hops, log-normal tool
pauses, context growing per hop, shared system prompts and tool schemas), interactive
chats, and the Mooncake trace turned into token-id requests. Seeded and deterministic."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True)
class Hop:
    new_token_ids: tuple[int, ...]  # the user task (hop 0) or the previous tool's result
    pause_s: float  # tool call after this hop (0: the last hop)
    expected_tool_ms: int  # the caller's guess


@dataclass(frozen=True)
class Program:
    program_id: str
    start_s: float
    prefix_token_ids: tuple[int, ...]  # shared system prompt + tool schemas
    hops: tuple[Hop, ...]


@dataclass(frozen=True)
class Chat:
    chat_id: str
    start_s: float
    prompt_token_ids: tuple[int, ...]


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, vocab) for _ in range(n))


def make_workload(args, vocab: int, max_context: int) -> tuple[list[Program], list[Chat]]:
    rng = random.Random(args.seed)
    systems = [_tokens(rng, 96, vocab) for _ in range(3)]
    tool_schemas = [_tokens(rng, 64, vocab) for _ in range(2)]
    chat_system = _tokens(rng, 48, vocab)
    programs, t = [], 0.0
    rate = args.num_programs / args.duration_s
    for i in range(args.num_programs):
        t += rng.expovariate(rate)
        num_hops = min(args.max_hops, 1 + int(rng.lognormvariate(1.0, 0.9)))
        prefix = systems[i % 3] + tool_schemas[i % 2]
        hops, ctx = [], len(prefix)
        for h in range(num_hops):
            new = _tokens(rng, 32 if h == 0 else rng.randint(24, 64), vocab)
            ctx += len(new) + 12
            if ctx > max_context:
                break
            pause = rng.lognormvariate(math.log(args.tool_median_s), 0.8) if h < num_hops - 1 else 0.0
            guess = int(pause * 1000 * rng.lognormvariate(0.0, 0.3))
            hops.append(Hop(new, pause, guess))
        hops[-1] = Hop(hops[-1].new_token_ids, 0.0, 0)
        programs.append(Program(f"prog-{i}", t, prefix, tuple(hops)))
    chats, t = [], 0.0
    rate = args.num_chats / args.duration_s
    for i in range(args.num_chats):
        t += rng.expovariate(rate)
        chats.append(Chat(f"chat-{i}", t, chat_system + _tokens(rng, rng.randint(32, 96), vocab)))
    return programs, chats


def trace_workload(args, vocab: int, max_context: int) -> list[Chat]:
    """Mooncake lines → one-shot requests: each hash id is a deterministic block of
    tokens, so lines sharing hash-id prefixes share token prefixes."""
    lines = [json.loads(x) for x in TRACE.read_text().splitlines() if x.strip()]
    step = max(1, len(lines) // max(1, args.trace_requests))
    lines = lines[::step][: args.trace_requests]
    t0, t1 = lines[0]["timestamp"], lines[-1]["timestamp"]
    scale = args.trace_duration_s / max(1, t1 - t0)
    max_blocks = max(1, (max_context - 64) // args.trace_block_tokens)
    out = []
    for i, line in enumerate(lines):
        ids = []
        for h in line["hash_ids"][:max_blocks]:
            ids.extend(_tokens(random.Random(h * 7919 + 17), args.trace_block_tokens, vocab))
        out.append(Chat(f"trace-{i}", (line["timestamp"] - t0) * scale, tuple(ids)))
    return out


# -- the peer comparison's workload (issue 17: `weft bench agentic --peer llama-server`) ----
@dataclass(frozen=True)
class PeerWorkloadSpec:
    """The agent workload the peer comparison replays; every engine gets the same one."""

    num_programs: int = 24  # run by a closed loop of `concurrency` programs at once
    concurrency: int = 8
    min_hops: int = 3
    max_hops: int = 16
    pareto_alpha: float = 1.3  # tail of the hop count: P(extra > x) ~ x^-alpha
    tool_median_s: float = 0.5  # log-normal tool pause, sigma 0.6
    output_tokens: int = 16  # per hop and per interactive request
    interactive_rate_per_s: float = 1.0  # Poisson, while programs run
    system_tokens: int = 256  # two shared system prompts ...
    tools_tokens: int = 128  # ... each with its tool schemas

    def __post_init__(self) -> None:
        if not 1 <= self.min_hops <= self.max_hops:
            raise ValueError("need 1 <= min_hops <= max_hops")
        if self.num_programs < 1 or self.concurrency < 1 or self.output_tokens < 1:
            raise ValueError("num_programs, concurrency and output_tokens must be >= 1")
        if self.pareto_alpha <= 0 or self.tool_median_s < 0 or self.interactive_rate_per_s < 0:
            raise ValueError("pareto_alpha must be > 0, tool_median_s and interactive_rate_per_s >= 0")


def peer_hop_count(rng: random.Random, spec: PeerWorkloadSpec) -> int:
    """min_hops + a Pareto-tailed extra, capped: most programs are short, a few run to the cap."""
    extra = int(3.0 * (rng.paretovariate(spec.pareto_alpha) - 1.0))
    return min(spec.max_hops, spec.min_hops + extra)


def make_peer_workload(spec: PeerWorkloadSpec, seed: int, vocab: int, max_context: int,
                       max_chats: int = 2000) -> tuple[list[Program], list[Chat]]:
    """Programs (start_s 0: the driver's closed loop starts them in list order) and a long
    enough Poisson stream of interactive chats (the driver sends those due before the last
    program ends). Deterministic in ``seed``; every prompt + outputs fits ``max_context``."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, spec.system_tokens, vocab) + _tokens(rng, spec.tools_tokens, vocab) for _ in range(2)]
    chat_system = _tokens(rng, 64, vocab)
    programs = []
    for i in range(spec.num_programs):
        num_hops = peer_hop_count(rng, spec)
        prefix = prefixes[i % 2]
        hops, ctx = [], len(prefix)
        for h in range(num_hops):
            new = _tokens(rng, 64 if h == 0 else rng.randint(32, 160), vocab)
            if ctx + len(new) + spec.output_tokens > max_context:
                break
            ctx += len(new) + spec.output_tokens
            pause = rng.lognormvariate(math.log(spec.tool_median_s), 0.6) if spec.tool_median_s else 0.0
            hops.append(Hop(new, pause, int(pause * 1000)))
        hops[-1] = Hop(hops[-1].new_token_ids, 0.0, 0)  # the last hop calls no tool
        programs.append(Program(f"prog-{i}", 0.0, prefix, tuple(hops)))
    chats, t = [], 0.0
    for i in range(max_chats if spec.interactive_rate_per_s else 0):
        t += rng.expovariate(spec.interactive_rate_per_s)
        chats.append(Chat(f"chat-{i}", t, chat_system + _tokens(rng, rng.randint(32, 96), vocab)))
    return programs, chats
