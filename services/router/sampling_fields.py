"""The sampler's filters and penalties a request body may set, validated for ``Sampling``:
``logit_bias``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, and the number of completions ``n`` (with ``best_of``).

Ranges are OpenAI's where it defines one (penalties in [-2, 2], bias in [-100, 100]) and
vLLM's otherwise (``repetition_penalty`` > 0, ``min_p`` in [0, 1]). Each refusal names the
field; the executor validates again (``services/executor/engine/sampling_params.py``), so
these checks only make the 400 come before anything is queued.

NOTE: sizes are bounded before anything is walked: a ``logit_bias`` is counted before its
keys are parsed (every entry is a bias applied to the logits at every step), and ``n`` is
capped because each completion is one downstream request holding its own KV blocks.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.json_fields import json_object, json_type, optional_field

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 64  # completions per prompt: each is a downstream request with its own KV
MAX_BIAS = 100.0


def parse_logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"<token id>": bias}`` -> ((id, bias), ...) sorted by id (``Sampling.logit_bias``)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    obj = json_object(value, "logit_bias")
    if len(obj) > MAX_LOGIT_BIAS_ENTRIES:  # counted before any key is parsed
        raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(obj)}")
    bias: dict[int, float] = {}
    for key, b in obj.items():
        token = _token_key(key, vocab_size)
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
            shown = repr(b) if isinstance(b, (int, float)) else json_type(b)
            raise InvalidRequestError(f"logit_bias.{key[:20]}", f"must be a number in [-100, 100], got {shown}")
        bias[token] = float(b)
    return tuple(sorted(bias.items()))


def _token_key(key: str, vocab_size: int) -> int:
    """A key of ``logit_bias``: a token id in decimal ("17", as OpenAI's tokenizer ids)."""
    if not (isinstance(key, str) and 0 < len(key) <= 12 and key.isascii() and key.isdigit()):
        raise InvalidRequestError(f"logit_bias.{str(key)[:20]}", "keys must be token ids (decimal strings)")
    token = int(key)
    if token >= vocab_size:
        raise InvalidRequestError(f"logit_bias.{key}", f"token id {token} is outside [0, {vocab_size})")
    return token


def parse_penalties(body: Mapping[str, Any]) -> dict[str, float]:
    """min_p, repetition_penalty, presence_penalty, frequency_penalty (``Sampling`` kwargs)."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = optional_field(body, name, float, 0.0)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        out[name] = float(value)
    min_p = optional_field(body, "min_p", float, 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequestError("min_p", f"must be in [0, 1], got {min_p}")
    repetition = optional_field(body, "repetition_penalty", float, 1.0)
    if not 0.0 < repetition <= 10.0:  # 1: off; > 1 discourages repeats, < 1 encourages them
        raise InvalidRequestError("repetition_penalty", f"must be in (0, 10], got {repetition}")
    out.update(min_p=float(min_p), repetition_penalty=float(repetition))
    return out


def parse_n(body: Mapping[str, Any], max_n: int = MAX_N) -> int:
    """``n`` completions per prompt; ``best_of`` is accepted only equal to ``n`` (Weft
    returns every completion it samples: ranking more than it returns is not done)."""
    n = optional_field(body, "n", int, 1)
    if not 1 <= n <= max_n:
        raise InvalidRequestError("n", f"must be in [1, {max_n}], got {n}")
    best_of = body.get("best_of")
    if best_of is not None:
        ok = isinstance(best_of, (int, float)) and not isinstance(best_of, bool) and best_of == n
        if not ok:
            raise InvalidRequestError("best_of", f"is not supported yet unless equal to n ({n}): completions are "
                                      f"not ranked; omit it, got {best_of!r}")
    return n
