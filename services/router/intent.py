"""Intent pre-screen: cheap request features → request class and a contract template.

NOTE: this runs on every request before anything is sent downstream, so it reads
only what is already parsed (no tokenizer, no model) and costs a few microseconds:

    declared class                 → kept (the caller knows best)
    session id, hop > 0, or tools  → agentic       (a hop of an agent program)
    long prompt and long output    → batch         (≥ 8k prompt tokens and ≥ 1k max_tokens, no session)
    otherwise                      → the tenant's default class, else interactive

The template fills only the contract fields the caller left at zero: interactive
turns get a TTFT ceiling with reroute as the fallback; agent hops a looser one that
degrades; batch work has no ceiling.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from services.router.schema import ContractSpec, Session
from services.shared.vocabulary import REQUEST_CLASS_LABELS, RequestClass

BATCH_PROMPT_TOKENS = 8192
BATCH_MAX_TOKENS = 1024

TEMPLATES: dict[RequestClass, ContractSpec] = {
    RequestClass.INTERACTIVE: ContractSpec(ttft_ceiling_ms=2000, fallback="reroute"),
    RequestClass.AGENTIC: ContractSpec(ttft_ceiling_ms=10000, fallback="degrade"),
    RequestClass.DETERMINISTIC: ContractSpec(fallback="degrade"),
    RequestClass.BATCH: ContractSpec(fallback="degrade"),
}


@dataclass(frozen=True)
class IntentFeatures:
    """What the pre-screen reads; classes are ``RequestClass`` labels ("" = none)."""

    declared_class: str
    has_session: bool
    hop_index: int
    has_tools: bool
    num_prompt_tokens: int
    max_tokens: int
    tenant_default_class: str = ""


def classify(f: IntentFeatures) -> str:
    """The request class (its label, as the wire and HTTP carry it) for these features. Pure."""
    if f.declared_class:
        return f.declared_class
    if f.has_session or f.hop_index > 0 or f.has_tools:
        return RequestClass.AGENTIC.value
    if f.num_prompt_tokens >= BATCH_PROMPT_TOKENS and f.max_tokens >= BATCH_MAX_TOKENS:
        return RequestClass.BATCH.value
    return f.tenant_default_class or RequestClass.INTERACTIVE.value


def with_template(contract: ContractSpec, request_class: str) -> ContractSpec:
    """The caller's contract with zero fields filled from the class's template."""
    t = TEMPLATES[RequestClass(request_class)] if request_class in REQUEST_CLASS_LABELS else ContractSpec()
    return replace(
        contract,
        ttft_ceiling_ms=contract.ttft_ceiling_ms or t.ttft_ceiling_ms,
        tpot_ceiling_ms=contract.tpot_ceiling_ms or t.tpot_ceiling_ms,
        fallback=contract.fallback or t.fallback,
    )


def prescreen(session: Session, has_tools: bool, num_prompt_tokens: int, max_tokens: int,
              tenant_default_class: str = "") -> Session:
    """The session info with its class and contract decided."""
    cls = classify(IntentFeatures(session.request_class, bool(session.session_id), session.hop_index, has_tools,
                                  num_prompt_tokens, max_tokens, tenant_default_class))
    return replace(session, request_class=cls, contract=with_template(session.contract, cls))
