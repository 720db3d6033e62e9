"""``weft bench agentic --peer llama-server``: issue 17's agent workload against llama.cpp's
server on the same GGUF weights, against a default ``weft up`` mesh with and without the
agent hints, and against Weft's FCFS ablation.

Workload (benchmarks/agentic_workload.py, ``PeerWorkloadSpec``): programs of 3–16 hops
(Pareto-tailed), each hop sends the whole context as token ids (system prompt + tools +
every earlier hop's task/tool result and output), then a log-normal tool pause (median
0.5 s); a closed loop keeps 8 programs running at once; meanwhile interactive requests
arrive as a Poisson stream (~1/s). Every request streams, so TTFT is the first token's
arrival at the client.

Engines (benchmarks/agentic_engines.py; all started once per model, each with its own
warm-up, then left running):

  llama-server    ``llama-server -np 6`` (continuous batching, prompt cache on), the f32 GGUF
                  of benchmarks/peers/weights.py; /completion with token-id prompts, stream
  weft            a default ``weft up`` mesh (launcher processes on loopback); hops carry
                  session_id, program_id, hop_index, expected_tool_ms and request_class
                  agentic, chats request_class interactive; a finished program ends its
                  session (EndSession), as an agent framework would
  weft-no-hints   another default mesh; requests carry no session info at all
  weft-fcfs       ``--policy fcfs --preemption-policy fcfs --no-demote``, hints sent

Each seed's workload is replayed once per engine, engines in a rotated order per seed (the
first slot moves), so no configuration always runs first. Results: a section of
benchmarks/results/agentic.md (between its peer markers) and agentic_peer_*.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import agentic_peer_report as rep  # noqa: E402
from benchmarks.agentic_engines import Hints, LlamaServer, WeftMesh  # noqa: E402
from benchmarks.agentic_workload import Chat, PeerWorkloadSpec, Program, make_peer_workload  # noqa: E402

WEFT_SETTINGS, ABLATIONS = rep.WEFT_SETTINGS, rep.ABLATIONS  # the configurations, in the report module


@dataclass
class RunLog:
    jct_s: list[float] = field(default_factory=list)
    ttft_int_s: list[float] = field(default_factory=list)
    ttft_hop_s: list[float] = field(default_factory=list)
    num_errors: int = 0


async def replay(engine, config: str, tag: str, programs: list[Program], chats: list[Chat], spec: PeerWorkloadSpec,
                 deadline_s: float, bar=None) -> rep.RunSummary:
    """One closed-loop replay: ``spec.concurrency`` programs at once, chats due before the last
    program ends. ``tag`` keeps request and session ids unique across runs. At ``deadline_s``
    what is still running is cancelled and counted *censored*: a program's completion time
    and a chat's TTFT as the time it had waited so far (a lower bound: an engine that runs out
    of time is never made to look slower than it was)."""
    log, hinted = RunLog(), not config.startswith(rep.NO_HINTS)
    queue = list(programs)
    running: dict[str, float] = {}  # program or chat id -> start, until it finishes / gets a first token
    done = asyncio.Event()

    async def program_worker() -> None:
        while queue:
            p = queue.pop(0)
            context, start = list(p.prefix_token_ids), time.perf_counter()
            running[p.program_id] = start
            try:
                for h, hop in enumerate(p.hops):
                    context.extend(hop.new_token_ids)
                    hints = Hints("agentic", f"{tag}-{p.program_id}", h, hop.expected_tool_ms) if hinted else None
                    ttft, out = await engine.generate(f"{tag}-{p.program_id}-h{h}", context, spec.output_tokens, hints)
                    log.ttft_hop_s.append(ttft)
                    context.extend(out)
                    if bar is not None:
                        bar.update(1)
                    if hop.pause_s:
                        await asyncio.sleep(hop.pause_s)  # the tool runs
                log.jct_s.append(time.perf_counter() - start)
                if hinted:  # after the clock: the program is done
                    await engine.end_session(f"{tag}-{p.program_id}")
            except Exception as exc:  # counted and reported, the run goes on
                log.num_errors += 1
                print(f"  [{config}] {p.program_id} failed: {exc!r}"[:300], flush=True)
            running.pop(p.program_id, None)

    async def one_chat(c: Chat) -> None:
        running[c.chat_id] = time.perf_counter()

        def first(ttft: float) -> None:
            running.pop(c.chat_id, None)
            log.ttft_int_s.append(ttft)
        try:
            await engine.generate(f"{tag}-{c.chat_id}", list(c.prompt_token_ids), spec.output_tokens,
                                  Hints("interactive") if hinted else None, on_first=first)
        except Exception as exc:
            log.num_errors += 1
            print(f"  [{config}] {c.chat_id} failed: {exc!r}"[:300], flush=True)

    sent: list[asyncio.Task] = []

    async def chat_source(t0: float) -> None:
        for c in chats:
            delay = t0 + c.start_s - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(done.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if done.is_set():
                break
            sent.append(asyncio.create_task(one_chat(c)))
        await asyncio.gather(*sent)

    t0 = time.perf_counter()
    chatter = asyncio.create_task(chat_source(t0))
    workers = [asyncio.create_task(program_worker()) for _ in range(spec.concurrency)]
    await asyncio.wait(workers, timeout=deadline_s)
    done.set()
    await asyncio.wait([chatter], timeout=max(1.0, deadline_s - (time.perf_counter() - t0)))
    now = time.perf_counter()
    num_censored = 0
    for task in [*workers, chatter, *sent]:
        if not task.done():
            task.cancel()
    for rid, start in running.items():  # lower bounds for what the deadline cut off
        (log.jct_s if rid.startswith("prog-") else log.ttft_int_s).append(now - start)
        num_censored += 1
    num_censored += len(queue)  # programs never started count as censored, with no time
    await asyncio.gather(*workers, chatter, *sent, return_exceptions=True)
    return rep.summarize(config, 0, log.jct_s, log.ttft_int_s, log.ttft_hop_s, log.num_errors, now - t0,
                         num_censored)


def make_engine(config: str, model, args):
    if config == rep.PEER:
        return LlamaServer(model.gguf, slots=args.peer_slots, ctx_per_slot=args.ctx_per_slot, threads=args.threads,
                           http_threads=args.peer_http_threads)
    return WeftMesh(config, model.model_dir, args.state_dir / model.name, WEFT_SETTINGS[config])


async def run_model(args, model_name: str) -> list[rep.RunSummary]:
    """Start every engine, warm each up, then the seeds, engines rotated per seed."""
    from tqdm.auto import tqdm

    from benchmarks.peers.weights import peer_model

    model = peer_model(model_name)
    config = json.loads((Path(model.model_dir) / "config.json").read_text())
    max_context = min(config["max_position_embeddings"], args.ctx_per_slot) - args.spec.output_tokens - 8
    engines = {c: make_engine(c, model, args) for c in args.configs}
    runs: list[rep.RunSummary] = []
    try:
        for c, engine in engines.items():
            print(f"[{model_name}] starting {c} ...", flush=True)
            await engine.start()
        for engine in engines.values():
            if isinstance(engine, WeftMesh):
                await engine.connect()
        warm_spec = PeerWorkloadSpec(num_programs=args.spec.concurrency, concurrency=args.spec.concurrency,
                                     min_hops=2, max_hops=3, tool_median_s=0.1, output_tokens=args.spec.output_tokens)
        warm = make_peer_workload(warm_spec, 10_000, config["vocab_size"], max_context)
        for c, engine in engines.items():
            print(f"[{model_name}] warm-up {c} ...", flush=True)
            await replay(engine, c, f"warm-{c}", *warm, warm_spec, args.run_timeout_s)
        for k, seed in enumerate(args.seeds):
            programs, chats = make_peer_workload(args.spec, seed, config["vocab_size"], max_context)
            order = args.configs[k % len(args.configs):] + args.configs[:k % len(args.configs)]
            for c in order:
                total = sum(len(p.hops) for p in programs)
                with tqdm(total=total, desc=f"{model_name} seed {seed} {c}", unit="hop", leave=False) as bar:
                    s = await replay(engines[c], c, f"{c}-s{seed}", programs, chats, args.spec, args.run_timeout_s,
                                     bar)
                await asyncio.sleep(2.0)  # cancelled work drains before the next engine's run
                s = rep.RunSummary(**{**s.__dict__, "seed": seed})
                runs.append(s)
                print(f"[{model_name}] seed {seed} {c}: program p99 {s.jct_p99_s:.1f} s, interactive TTFT p99 "
                      f"{s.ttft_int_p99_ms:.0f} ms ({s.num_chats} chats), {s.num_errors} errors, {s.num_censored} cut off by the "
                      f"deadline, {s.wall_s:.0f} s",
                      flush=True)
    finally:
        for engine in engines.values():
            await engine.stop()
    return runs


def machine() -> str:
    """The header's machine: CPUs, model, whether AVX-512, and the 1-minute load average at
    the start (other work on the box shows there; the harness cannot know more)."""
    from benchmarks.report import cpu_name

    try:
        avx512 = " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        avx512 = False
    return (f"{os.cpu_count()} CPUs ({cpu_name()}{' with AVX-512' if avx512 else ''}; 1-minute load average "
            f"{os.getloadavg()[0]:.2f} at the start)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="weft bench agentic --peer llama-server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=["llama-server"], required=True, help="the peer engine compared with")
    p.add_argument("--model", choices=["smollm2", "bench", "both"], default="both",
                   help="SmolLM2-135M-Instruct, the 55 M bench preset, or both (default: both)")
    p.add_argument("--configs", default=",".join(rep.CONFIGS),
                   help=f"comma-separated configurations (default: all of {', '.join(rep.CONFIGS)}); one-difference "
                        f"ablations of the default mesh (hints sent unless the name starts with {rep.NO_HINTS}): "
                        f"{', '.join(ABLATIONS)}")
    p.add_argument("--seeds", default="0,1,2", help="workload seeds, each replayed once per configuration")
    p.add_argument("--num-programs", type=int, default=24, help="agent programs per seed (default: 24)")
    p.add_argument("--concurrency", type=int, default=8, help="programs running at once (default: 8)")
    p.add_argument("--max-hops", type=int, default=16, help="cap of the Pareto-tailed hop count (default: 16)")
    p.add_argument("--tool-median-s", type=float, default=0.5, help="median log-normal tool pause (default: 0.5)")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens generated per hop and chat (default: 16)")
    p.add_argument("--interactive-rate", type=float, default=1.0, help="interactive requests per second (default: 1)")
    p.add_argument("--run-timeout-s", type=float, default=240.0,
                   help="deadline of one run; what is unfinished then counts with its time so far (default: 240)")
    p.add_argument("--peer-slots", type=int, default=6, help="llama-server -np (default: 6)")
    p.add_argument("--peer-http-threads", type=int, default=64,
                   help="llama-server --threads-http (default: 64; its own default, -np + 2, leaves requests beyond "
                        "8 open ones waiting for a connection thread instead of in its queue)")
    p.add_argument("--ctx-per-slot", type=int, default=4096, help="llama-server context per slot; prompts fit it")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server threads (default: all CPUs; "
                   "Weft's executor takes torch's choice, also all CPUs)")
    p.add_argument("--state-dir", type=Path, default=ROOT / ".weft" / "bench-agentic-peer", help="meshes' state")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="agentic.md and PNGs")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in args.configs if c not in rep.CONFIGS + ABLATIONS]:
        p.error(f"unknown configs {unknown}; choose from {list(rep.CONFIGS + ABLATIONS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.spec = PeerWorkloadSpec(num_programs=args.num_programs, concurrency=args.concurrency,
                                 max_hops=args.max_hops, tool_median_s=args.tool_median_s,
                                 output_tokens=args.output_tokens, interactive_rate_per_s=args.interactive_rate)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    models = ["smollm2", "bench"] if args.model == "both" else [args.model]
    s = args.spec
    md = args.out_dir / "agentic.md"
    document = md.read_text() if md.exists() else "# Agentic benchmark\n"
    outer = rep.section_text(document) or rep.HEADER
    for m in models:
        lines = [f"Command: `weft bench agentic {' '.join(sys.argv[3:] if argv is None else argv)}`  ",
                 f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {machine()}, no GPU", "",
                 f"Workload per seed: {s.num_programs} programs of {s.min_hops}–{s.max_hops} hops (Pareto alpha "
                 f"{s.pareto_alpha}), {s.concurrency} at once, {s.output_tokens} output tokens per hop and chat, "
                 f"log-normal tool pauses (median {s.tool_median_s} s), interactive requests at "
                 f"{s.interactive_rate_per_s}/s; llama-server `-np {args.peer_slots} -t {args.threads} --threads-http "
                 f"{args.peer_http_threads}`; seeds "
                 f"{args.seeds}; a run's deadline {args.run_timeout_s:.0f} s.", ""]
        runs = asyncio.run(run_model(args, m))
        section = rep.model_section(m, runs, rep.charts(args.out_dir, args.configs, m, runs))
        section = section[:2] + lines + section[2:]  # after the "### model" heading
        outer = rep.splice_section(outer, "\n".join(section), key=f"peer-{m}", at_end=True)
        document = rep.splice_section(document, outer)
        md.write_text(document)  # after each model: a later failure keeps what was measured
        print("\n".join(section), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
