"""``POST /v1/embeddings`` (OpenAI's embeddings API) over the cachestore's embedding model.

The router does not embed: ``weft.v1.CacheStore.Embed`` runs all-MiniLM-L6-v2 (the model
the semantic cache already uses), so the route exists only where the router has a
cachestore (``--cachestore-address``). Wiring (``http_api.py`` / ``app.py``)::

    api = EmbeddingsApi(cachestore_client, tokenizer)    # CacheStoreClient, router Tokenizer
    app.router.add_post("/v1/embeddings", handler)        # handler: tenant = self._tenant(request)
    return await api.handle(await self._json(request), tenant)   # -> web.Response

``handle`` takes the decoded JSON body (``HttpApi._json``: size cap, read timeout, hostile
JSON) and the authenticated tenant (``HttpApi._tenant``: 401 without a valid key when keys
are configured). Bad input raises ``InvalidRequestError`` naming the field (the HTTP
middleware's 400 with ``param``); a cachestore that is down or slow is answered here as 503
with ``Retry-After``, never a 500.

Request fields:

    input             a string, strings, token ids or lists of token ids (ids are decoded
                      with the served model's tokenizer: the embedding model has its own
                      vocabulary); at most MAX_INPUTS items, MAX_INPUT_CHARS characters each,
                      MAX_TOTAL_INPUT_BYTES (UTF-8) in all, none empty
    model             the embedding model's id (``all-MiniLM-L6-v2``), not the chat model's
    encoding_format   ``float`` (default) or ``base64`` (little-endian float32, as OpenAI)
    dimensions        accepted only when equal to the model's (384): MiniLM has no
                      shortened embeddings
    user              no effect

``usage.prompt_tokens`` counts the embedding model's word pieces (after its truncation to
256), which is what was computed; ``total_tokens`` equals it.
"""
from __future__ import annotations

import base64
import struct
from collections.abc import Sequence

import grpc
from aiohttp import web

from services.router.cachestore_client import CacheStoreClient
from services.router.errors import InvalidRequestError
from services.router.json_body import OversizeInt
from services.router.openai_format import error_body
from services.shared.tokenizer import Tokenizer

EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # services/cachestore/embedder.py MODEL_NAME
EMBEDDING_DIM = 384
MAX_INPUTS = 256  # the cachestore's per-call cap (semantic_service.MAX_TEXTS)
MAX_INPUT_CHARS = 64 * 1024  # ditto (MAX_TEXT_CHARS); MiniLM reads 256 word pieces anyway
MAX_INPUT_TOKEN_IDS = 64 * 1024
# All inputs together, UTF-8: one Embed message, which the cachestore refuses past its
# max_message_bytes (8 MiB by default) with RESOURCE_EXHAUSTED, a "retry shortly" 503 that
# no retry could ever pass. MiniLM reads 256 word pieces of each input anyway.
MAX_TOTAL_INPUT_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 1


class EmbeddingsApi:
    """Serves ``/v1/embeddings`` through a ``CacheStoreClient``'s channel."""

    def __init__(self, cachestore: CacheStoreClient, tokenizer: Tokenizer | None = None,
                 model_name: str = EMBEDDING_MODEL, dim: int = EMBEDDING_DIM, timeout_s: float = 30.0) -> None:
        self.cachestore = cachestore
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.dim = dim
        self.timeout_s = timeout_s  # the cachestore loads the model on its first call

    def model_card(self) -> dict:
        """The ``/v1/models`` entry of the embedding model."""
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "weft"}

    async def handle(self, body: object, tenant: str) -> web.Response:
        """The OpenAI response for a decoded request body of ``tenant``."""
        del tenant  # embeddings are stateless: nothing is cached or shared across tenants
        texts, encoding = self.parse(body)
        try:
            reply = await self.cachestore.embed(texts, self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            return _upstream_error(exc)
        data = [{"object": "embedding", "index": i, "embedding": _encode(vector, encoding)}
                for i, vector in enumerate(reply.vectors)]
        used = sum(reply.num_tokens)
        return web.json_response({"object": "list", "data": data, "model": reply.model or self.model_name,
                                  "usage": {"prompt_tokens": used, "total_tokens": used}})

    def parse(self, body: object) -> tuple[list[str], str]:
        """The texts to embed and the encoding; raises ``InvalidRequestError`` naming the field."""
        if not isinstance(body, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or model != self.model_name:
            shown = model[:200] if isinstance(model, str) else model
            raise InvalidRequestError("model", f"model {shown!r} is not an embedding model; "
                                               f"embedding models: [{self.model_name!r}]")
        encoding = body.get("encoding_format")
        if encoding is None:
            encoding = "float"
        if encoding not in ("float", "base64"):
            raise InvalidRequestError("encoding_format", f"must be 'float' or 'base64', got {str(encoding)[:40]!r}")
        dims = body.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or dims != self.dim):
            raise InvalidRequestError("dimensions", f"{self.model_name} has {self.dim} dimensions and no "
                                                    f"shortened embeddings; got {dims}")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise InvalidRequestError("user", "must be a string")
        return self._texts(body.get("input")), encoding

    def _texts(self, value: object) -> list[str]:
        if isinstance(value, str):
            items: Sequence[object] = [value]
        elif isinstance(value, list) and value and all(_is_id_shaped(v) for v in value):
            items = [value]  # one prompt as token ids
        elif isinstance(value, list):
            items = value
        else:
            raise InvalidRequestError("input", "must be a string, an array of strings, an array of token ids "
                                               "or an array of token-id arrays")
        if not items:
            raise InvalidRequestError("input", "must not be empty")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError("input", f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
        single = isinstance(value, str) or items is not value
        texts = [self._text(item, "input" if single else f"input[{i}]") for i, item in enumerate(items)]
        total = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if total > MAX_TOTAL_INPUT_BYTES:
            raise InvalidRequestError("input", f"at most {MAX_TOTAL_INPUT_BYTES} bytes of text per request in all, "
                                               f"got {total}; split it into several requests")
        return texts

    def _text(self, item: object, field: str) -> str:
        if isinstance(item, list):
            item = self._decode(item, field)
        elif not isinstance(item, str):
            raise InvalidRequestError(field, "must be a string or an array of token ids")
        if not item:
            raise InvalidRequestError(field, "must not be empty")
        if len(item) > MAX_INPUT_CHARS:
            raise InvalidRequestError(field, f"longer than {MAX_INPUT_CHARS} characters ({len(item)})")
        return item

    def _decode(self, ids: list, field: str) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError(field, "token ids are not accepted here: send text")
        if not ids:
            raise InvalidRequestError(field, "must not be empty")
        if len(ids) > MAX_INPUT_TOKEN_IDS:
            raise InvalidRequestError(field, f"at most {MAX_INPUT_TOKEN_IDS} token ids, got {len(ids)}")
        vocab = self.tokenizer.vocab_size
        for j, tok in enumerate(ids):
            if not _is_int(tok) or not 0 <= tok < vocab:
                raise InvalidRequestError(f"{field}[{j}]", f"must be a token id in [0, {vocab}), got {tok}")
        # Ids are the served model's; the embedding model re-reads their text in its own vocabulary.
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _is_id_shaped(value: object) -> bool:
    """An integer of any size: the list is read as token ids, and the range check names a bad one."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return _is_id_shaped(value) and not isinstance(value, OversizeInt)


def _encode(values: Sequence[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # what OpenAI's SDK decodes with numpy.frombuffer(dtype=float32)
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return list(values)


def _upstream_error(exc: grpc.aio.AioRpcError) -> web.Response:
    """503 + Retry-After for a cachestore that is down, draining or slow; a refusal of the
    input itself (it enforces the same caps) stays the caller's 400."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidRequestError("input", exc.details() or "refused by the embedding model")
    message = f"the embedding service is unavailable ({exc.code().name}); retry shortly"
    return web.json_response(error_body(503, message), status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
