"""Compiled grammars, cached: one compile per distinct (kind, text), bounded in count
and bytes (LRU), shared by every request of the engine.

Each compile runs on a daemon worker thread with a deadline (xgrammar releases the GIL
while compiling), so a hostile grammar (a huge or deeply nested schema, an exploding
regex) costs the caller at most ``compile_timeout_s`` of compiling (plus, when every worker
is busy, up to as long waiting for one) and then a clear ``InvalidRequestError``; the
engine thread never waits on it forever. A compile past its
deadline keeps its worker until xgrammar returns (native code cannot be interrupted; a
daemon thread at least never holds up process exit). A compile that finds every worker
busy waits for one within its own deadline (a client sending three new schemas at once
to a two-worker executor gets all three); it is refused at once (CapacityError, which is
RESOURCE_EXHAUSTED and is not remembered) only when every worker is held past its
deadline, when ``MAX_WAITING`` compiles already wait, or when its deadline passes while
it waits. Texts over ``max_grammar_bytes`` and
JSON nested deeper than ``MAX_JSON_DEPTH`` are refused before any compile, and so are
schemas whose ``pattern`` regexes would take seconds to compile (``pattern_cost.py``) or would
write unescaped characters into a JSON string (``json_strings.py``, which also makes
length-bounded strings JSON-safe). A failed
compile is remembered too, so a repeated bad grammar is refused without recompiling; a
grammar already compiling is joined, not compiled again (many requests sending one new
schema at once share one worker).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass

import structlog
import xgrammar as xgr

from services.executor.engine.sampling_params import GrammarSpec
from services.executor.errors import CapacityError, InvalidRequestError
from services.executor.grammar.json_strings import check_string_patterns, safe_string_chars
from services.executor.grammar.pattern_cost import MAX_PATTERN_UNITS, schema_pattern_units
from services.mesh import metrics

log = structlog.get_logger(__name__)

MAX_WAITING = 16  # compiles waiting for a free worker; more are refused at once
MAX_JSON_DEPTH = 64  # nesting of a json_schema / structural_tag document (each schema level is ~2)
COMPILE_SECONDS = metrics.histogram(
    "weft_executor_grammar_compile_seconds", "Wall time of one grammar compile (cache misses).", ["kind"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0))
CACHE_LOOKUPS = metrics.counter("weft_executor_grammar_cache_lookups_total",
                                "Compiled-grammar cache lookups by result.", ["result"])

_ANY_OBJECT = '{"type": "object"}'
# xgrammar prefixes its messages with "[time] /path/file.cc:line: " and sometimes a check text.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class GrammarLimits:
    max_entries: int = 256
    max_bytes: int = 512 * 1024 * 1024  # compiled grammars' own estimate of their memory
    max_grammar_bytes: int = 64 * 1024  # of the grammar's source text
    compile_timeout_s: float = 5.0
    compile_threads: int = 2


class GrammarCache:
    """Thread-safe: the engine thread and an async layer warming the cache may share it."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer_info = tokenizer_info
        self.limits = limits
        # xgrammar's own cache is off: this one is bounded, counted and holds failures.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=limits.compile_threads, cache_enabled=False)
        self.workers: dict[threading.Thread, float] = {}  # compiles in flight -> their start (monotonic),
        # past their deadline included
        self._entries: OrderedDict[tuple[str, str], xgr.CompiledGrammar | InvalidRequestError] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}  # compiles running, by (kind, text)
        self._bytes = 0
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when a worker leaves
        self._waiting = 0  # compiles waiting on _freed
        self.num_compiles = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The remembered result of ``spec`` without compiling or waiting: the compiled grammar,
        None when nothing is remembered (``get`` compiles it), or InvalidRequestError raised
        when it is remembered as invalid. Cheap: callers may use it on an event loop."""
        with self._lock:
            hit = self._entries.get((spec.kind, spec.text))
            if hit is not None:
                self._entries.move_to_end((spec.kind, spec.text))
        if hit is None:
            return None
        CACHE_LOOKUPS.labels("hit").inc()
        return _served(hit)

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; raises InvalidRequestError naming
        ``grammar.<kind>`` when it is too big, malformed, or too slow to compile."""
        key = (spec.kind, spec.text)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
        if hit is not None:
            CACHE_LOOKUPS.labels("hit").inc()
            return _served(hit)
        CACHE_LOOKUPS.labels("miss").inc()
        try:
            return self._compile(spec)
        except InvalidRequestError as e:
            self._store(key, e, 0)
            raise

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Check, then compile on a worker (or join the one compiling it) and wait."""
        _check_source(spec, self.limits.max_grammar_bytes)
        return self._await(spec, self._compiling(spec))

    def _compiling(self, spec: GrammarSpec) -> Future:
        """The compile of ``spec`` in flight, started here unless one already is: the same
        grammar sent by many requests at once is compiled once (each did start its own,
        and the busy workers refused the rest as if compiles had timed out). With every
        worker busy it waits for one, up to ``compile_timeout_s``."""
        key = (spec.kind, spec.text)
        limit = self.limits.compile_timeout_s
        deadline = time.monotonic() + limit
        with self._lock:
            while True:
                future = self._inflight.get(key)
                if future is not None:
                    return future
                hit = self._entries.get(key)
                if hit is not None:  # compiled (or refused) by another request while this one waited
                    future = Future()
                    try:
                        future.set_result(_served(hit))
                    except InvalidRequestError as e:
                        future.set_exception(e)
                    return future
                if len(self.workers) < self.limits.compile_threads:
                    break
                now = time.monotonic()
                stuck = all(now - started >= limit for started in self.workers.values())
                if stuck or now >= deadline or self._waiting >= MAX_WAITING:
                    # transient (not cached): RESOURCE_EXHAUSTED, retry later
                    raise CapacityError(f"grammar.{spec.kind}: the grammar compilers are busy; retry shortly")
                # Wake by the earliest of: a worker leaving, this caller's deadline, or the
                # moment the youngest busy worker passes its own (then all may be stuck).
                youngest = max(self.workers.values())
                self._waiting += 1
                try:
                    self._freed.wait(max(0.0, min(deadline, youngest + limit) - now))
                finally:
                    self._waiting -= 1
            future = Future()
            worker = threading.Thread(target=self._work, args=(spec, future), name="grammar-compile", daemon=True)
            self.workers[worker] = time.monotonic()
            self._inflight[key] = future
        try:
            worker.start()
        except RuntimeError as e:  # "can't start new thread": a thread limit, memory
            with self._lock:
                self.workers.pop(worker, None)
                self._inflight.pop(key, None)
                self._freed.notify_all()
            future.set_exception(CapacityError(f"grammar.{spec.kind}: no compile thread could start ({e}); "
                                               "retry shortly"))
        return future

    def _await(self, spec: GrammarSpec, future: Future) -> xgr.CompiledGrammar:
        field = f"grammar.{spec.kind}"
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            log.warning("grammar_compile_timeout", kind=spec.kind, chars=len(spec.text))
            raise InvalidRequestError(
                field, f"did not compile within {self.limits.compile_timeout_s:g}s; simplify it") from None
        except InvalidRequestError:  # remembered while this caller waited: already in its final form
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse / conversion errors
            raise InvalidRequestError(field, _NATIVE_PREFIX.sub("", str(e)).strip()) from None

    def _work(self, spec: GrammarSpec, future: Future) -> None:
        key = (spec.kind, spec.text)
        try:
            compiled = self._compile_now(spec)
            self._store(key, compiled, compiled.memory_size_bytes)  # before leaving _inflight: no gap
            future.set_result(compiled)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting callers
            future.set_exception(e)
        finally:
            with self._lock:
                self.workers.pop(threading.current_thread(), None)
                self._inflight.pop(key, None)
                self._freed.notify_all()

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with COMPILE_SECONDS.labels(spec.kind).time():
            self.num_compiles += 1
            c = self._compiler
            # Whitespace between JSON tokens is fixed (", " and ": "), not free: a small
            # model greedily decoding under "any whitespace" can pad forever.
            # Schemas go through xgrammar's converter and then json_strings.py, which makes
            # its length-bounded strings JSON-safe (0.2.9 lets raw control characters in).
            if spec.kind == "json_schema":
                return c.compile_grammar(safe_string_chars(xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)))
            if spec.kind == "json_object":  # OpenAI's json_object: any JSON object, not any value
                return c.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_grammar(safe_string_chars(xgr.Grammar.from_structural_tag(spec.text)))

    def _store(self, key: tuple[str, str], value, nbytes: int) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = value
            self._bytes += nbytes
            while self._entries and (len(self._entries) > self.limits.max_entries
                                     or self._bytes > self.limits.max_bytes):
                _, old = self._entries.popitem(last=False)
                if not isinstance(old, InvalidRequestError):
                    self._bytes -= old.memory_size_bytes

    def close(self) -> None:
        """Forget every entry (workers still compiling finish on their own)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def _served(hit: xgr.CompiledGrammar | InvalidRequestError) -> xgr.CompiledGrammar:
    """A remembered result, as a caller gets it: the compiled grammar, or a fresh copy of the
    remembered error raised (raising the one cached instance would chain every caller's
    frames onto its traceback and keep them, prompts included, alive with the entry)."""
    if isinstance(hit, InvalidRequestError):
        raise InvalidRequestError(hit.field, hit.message)
    return hit


def _check_source(spec: GrammarSpec, max_bytes: int) -> None:
    """Refuse, before compiling, what is too big or (for JSON documents) too deep."""
    field = f"grammar.{spec.kind}"
    size = len(spec.text.encode())
    if size > max_bytes:
        raise InvalidRequestError(field, f"{size} bytes is over the limit of {max_bytes}")
    if spec.kind not in ("json_schema", "structural_tag"):
        return
    try:
        doc = json.loads(spec.text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
    if _depth(doc, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidRequestError(field, f"is nested deeper than {MAX_JSON_DEPTH} levels")
    units = schema_pattern_units(doc)
    if units > MAX_PATTERN_UNITS:
        raise InvalidRequestError(field, f"its pattern regexes repeat too much to compile quickly ({units} "
                                  f"units, at most {MAX_PATTERN_UNITS}: each {{m,n}} counts n, nested ones "
                                  "more); shorten or un-nest the bounded repetitions")
    check_string_patterns(doc, spec.kind)


def _depth(doc: object, limit: int) -> int:
    """Nesting depth of a JSON value, iteratively; stops counting past ``limit``."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, d + 1) for child in children)
    return deepest
