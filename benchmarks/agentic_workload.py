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
