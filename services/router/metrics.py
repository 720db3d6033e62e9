"""The router's Prometheus metrics (served on ``--metrics-port``, not the public HTTP port)."""
from __future__ import annotations

from services.mesh import metrics

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = metrics.counter("weft_router_requests_total", "Requests by API, endpoint and status code",
                           ("api", "endpoint", "code"))
TTFT_S = metrics.histogram("weft_router_ttft_seconds", "Time from request arrival to the first token",
                           ("api",), _LATENCY_BUCKETS_S)
REQUEST_S = metrics.histogram("weft_router_request_seconds", "Time from request arrival to the last token",
                              ("api",), _LATENCY_BUCKETS_S)
PROMPT_TOKENS = metrics.counter("weft_router_prompt_tokens_total", "Prompt tokens sent downstream")
CACHED_TOKENS = metrics.counter("weft_router_cached_tokens_total", "Prompt tokens served from a prefix cache")
GENERATED_TOKENS = metrics.counter("weft_router_generated_tokens_total", "Tokens generated")
IN_FLIGHT = metrics.gauge("weft_router_in_flight_requests", "Generations currently streaming", ("api",))
DISCONNECTS = metrics.counter("weft_router_client_disconnects_total", "Streams cancelled by the client", ("api",))
