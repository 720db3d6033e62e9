"""llama.cpp as a peer: its own benchmark (``llama-batched-bench``) and greedy tokens
(``llama-server``), both from the build build_llamacpp.py made.

``llama-batched-bench -npp P -ntg T -npl 1,N`` prints one JSON line per batch size ``pl``:
``t_pp`` seconds to process the ``pl`` prompts, ``t_tg`` seconds for ``T`` decode steps of
``pl`` sequences, ``t`` their sum (model load excluded). ``speed_tg = pl * T / t_tg`` is its
decode-only rate; its ``speed`` counts prompt tokens too, so the harness computes output
tokens over ``t`` itself.
"""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.build_llamacpp import find_binary


@dataclass(frozen=True)
class BatchedBenchRow:
    """One batch size of one ``llama-batched-bench`` run."""

    num_sequences: int  # "pl"
    prompt_len: int  # "pp", tokens per sequence
    output_len: int  # "tg", decode steps
    prefill_s: float  # "t_pp"
    decode_s: float  # "t_tg"
    total_s: float  # "t" = t_pp + t_tg

    @property
    def output_tok_per_s(self) -> float:
        """Output tokens over prefill + decode, as Weft's generate is timed."""
        return self.num_sequences * self.output_len / self.total_s

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens of the decode steps over their time (llama.cpp's S_TG)."""
        return self.num_sequences * self.output_len / self.decode_s


def parse_batched_bench(text: str) -> dict[int, BatchedBenchRow]:
    """{pl: row} from ``--output-format jsonl`` output; log lines and other text are skipped.
    Raises ValueError on a JSON line without the timing fields."""
    rows: dict[int, BatchedBenchRow] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        try:
            row = BatchedBenchRow(int(d["pl"]), int(d["pp"]), int(d["tg"]), float(d["t_pp"]), float(d["t_tg"]),
                                  float(d["t"]))
        except KeyError as e:
            raise ValueError(f"llama-batched-bench line without {e}: {line}") from None
        rows[row.num_sequences] = row
    return rows


def batched_bench(gguf: Path, *, input_len: int, output_len: int, num_prompts: int, threads: int,
                  cache: Path | None = None) -> dict[int, BatchedBenchRow]:
    """One ``llama-batched-bench`` process at batch sizes 1 and ``num_prompts``."""
    ctx = num_prompts * (input_len + output_len) + 256
    cmd = [str(find_binary("llama-batched-bench", cache)), "-m", str(gguf), "-c", str(ctx),
           "-b", "2048", "-ub", "512", "-npp", str(input_len), "-ntg", str(output_len),
           "-npl", f"1,{num_prompts}", "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    found = parse_batched_bench(done.stdout + "\n" + done.stderr)
    if set(found) != {1, num_prompts}:
        raise SystemExit(f"llama-batched-bench printed no result for every batch size: {sorted(found)}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_greedy(gguf: Path, prompt: list[int], n: int, *, threads: int, cache: Path | None = None) -> list[int]:
    """The first ``n`` greedy tokens ``llama-server`` generates after the token ids ``prompt``
    (its end token, if it stops, is not among them)."""
    port = free_port()
    cmd = [str(find_binary("llama-server", cache)), "-m", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "-t", str(threads), "-c", "2048", "-np", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # polls the server's own readiness endpoint: the model loads in the meantime
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not come up (exit {proc.poll()}): {' '.join(cmd)}")
                time.sleep(0.5)
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(f"{base}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return list(json.load(r)["tokens"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
