"""The router's part of a request's timeline, and what happens when the request ends:
the latency histograms by class and tenant, the stored timeline and the p99 window.

``Generator.stream`` makes one ``RequestRecorder`` per request; the scheduler client
finds the trace through ``CURRENT_TRACE`` to send its ``traceparent`` and to attach the
spans the scheduler returns in its trailers.
"""
from __future__ import annotations

from services.mesh import metric_catalogue as catalogue
from services.mesh.timeline import CURRENT_TRACE, STORE, Trace
from services.router.attribution import ATTRIBUTION
from services.router.schema import TokenChunk, TokenRequest


class RequestRecorder:
    def __init__(self, request: TokenRequest) -> None:
        self.request_class = request.session.request_class
        self.tenant = request.tenant
        self.trace = Trace(request.request_id, "router", tenant=request.tenant,
                           request_class=catalogue.request_class_label(request.session.request_class),
                           num_prompt_tokens=len(request.prompt_token_ids))
        self.first_token_ns: int | None = None
        CURRENT_TRACE.set(self.trace)

    def on_chunk(self, chunk: TokenChunk) -> None:
        if self.first_token_ns is None and chunk.token_ids:
            self.first_token_ns = self.trace.event("router.first_token").start_ns

    def finish(self, finish_reason: str | None, num_output_tokens: int, executor: str) -> None:
        """Close the timeline; a request that finished (not cancelled, not failed) also
        feeds the latency histograms and the p99 window."""
        spans = self.trace.finish(STORE, finish_reason=finish_reason or "cancelled",
                                  num_output_tokens=num_output_tokens, executor=executor)
        if finish_reason is None:
            return
        root = self.trace.root
        ttft_s = (self.first_token_ns - root.start_ns) / 1e9 if self.first_token_ns is not None else None
        catalogue.observe_request(self.request_class, self.tenant, ttft_s, root.duration_s, num_output_tokens)
        ATTRIBUTION.observe(self.trace.request_id, spans, tenant=self.tenant)
