"""One request's place in its grammar: the object at ``Sequence.grammar``."""
from __future__ import annotations

from collections.abc import Sequence

import structlog
import xgrammar as xgr

log = structlog.get_logger(__name__)


class GrammarState:
    """Wraps one xgrammar GrammarMatcher.

    ``accept`` sees every output token (``Sequence.append_token`` calls it). A token the
    matcher rejects cannot come from a masked row, but must not take the engine down if
    it does (a bug elsewhere, a sampler that ignored the mask): it is logged and the state
    is marked ``failed``, which finishes the request like a terminated grammar.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, request_id: str = "") -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.request_id = request_id
        self.failed = False
        self.stop_token_ids: tuple[int, ...] = tuple(compiled.tokenizer_info.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and ``failed``) when the grammar rejects it."""
        if self.failed:
            return False
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token_id)):
            log.warning("grammar_rejected_token", request_id=self.request_id, token_id=int(token_id))
            self.failed = True
            return False
        return True

    def replay(self, token_ids: Sequence[int]) -> int | None:
        """Feed tokens an earlier attempt generated; the index of the first one rejected,
        or None when all were accepted."""
        for i, token in enumerate(token_ids):
            if not self.accept(token):
                return i
        return None

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    @property
    def finished(self) -> bool:
        """No further token can be accepted: terminated, or failed."""
        return self.failed or self.matcher.is_terminated()
