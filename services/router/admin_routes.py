"""The admin API of the live settings (docs/live_config.md).

    GET   /v1/weft/admin/settings   the document, keys listed by ``key_id`` (never the key itself)
    PATCH /v1/weft/admin/settings   a JSON merge patch (RFC 7386); ``If-Match: <version>``
                                    (or ``"version"`` in the body) refuses a stale change

Only an admin key (role ``admin`` in the keys file) may call them: no key or an unknown
one is 401, a tenant's key 403. A value that cannot apply is 400 naming the field
(``param``), a stale version 409, and neither changes anything. A change answers 200
with the new document; services apply it within ``WEFT_SETTINGS_REPUBLISH_S`` and report
the version they run (``weft ps``).

A key is listed as ``key_id(key)`` (services/mesh/live_settings.py): its first 4
characters (keys of 12 or more characters) and the first 12 hex digits of its SHA-256,
``"sk-a…3f2a9c1d0b7e": {"tenant": "acme", "role": "tenant"}``. Two keys that share a
prefix stay two entries. The body also carries the stamp that decides which router's
document wins (``updated_at``, ``writer``, ``origin``: services/router/live_settings.py).
"""
from __future__ import annotations

import json

import structlog
from aiohttp import web

from services.mesh.live_settings import LIVE_SETTINGS, SettingsError, redacted
from services.router.auth import bearer_token
from services.router.errors import AuthenticationError
from services.router.live_settings import CatchingUp, RouterLiveSettings, VersionConflict
from services.router.openai_format import error_body

log = structlog.get_logger(__name__)

PATH = "/v1/weft/admin/settings"


class AdminRoutes:
    def __init__(self, live: RouterLiveSettings) -> None:
        self.live = live

    def register(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.get)
        app.router.add_patch(PATH, self.patch)

    def _refusal(self, request: web.Request) -> web.Response | None:
        """401 / 403 unless the caller holds an admin key."""
        key = bearer_token(request.headers.get("Authorization")) or request.headers.get("x-api-key")
        try:
            admin = self.live.keys.is_admin(key)
        except AuthenticationError as exc:
            return web.json_response(error_body(401, str(exc), None, "invalid_api_key"), status=401)
        if not admin:
            log.warning("admin_api_refused", key=redacted(key or ""), path=request.path)
            return web.json_response(error_body(403, "the admin API needs a key with role 'admin' in the keys file",
                                                None, "not_admin"), status=403)
        return None

    async def get(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        return web.json_response(self._body(), headers={"ETag": str(self.live.document.version)})

    async def patch(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        try:
            patch = json.loads(await request.read() or b"null")
        except ValueError as exc:
            return _bad_request("(body)", f"not JSON: {exc}")
        except RecursionError:  # json's decoder recurses once per level: a 500 before
            return _bad_request("(body)", "nested too deeply")
        expected = request.headers.get("If-Match")
        try:
            expected_version = int(expected.strip().removeprefix("W/").strip('"')) if expected else None
        except ValueError:
            return _bad_request("If-Match", f"must be a version number, got {expected!r}")
        try:
            doc = await self.live.patch_when_caught_up(patch, expected_version)
        except CatchingUp as exc:
            return web.json_response(error_body(503, str(exc), None, "settings_catching_up"), status=503,
                                     headers={"Retry-After": "1"})
        except VersionConflict as exc:
            return web.json_response(error_body(409, str(exc), "version", "version_conflict"), status=409,
                                     headers={"ETag": str(self.live.document.version)})
        except SettingsError as exc:
            return _bad_request(exc.field, str(exc))
        except RecursionError:  # merge_patch recurses per level of a deep (but parseable) patch
            return _bad_request("(body)", "nested too deeply")
        return web.json_response(self._body(), headers={"ETag": str(doc.version)})

    def _body(self) -> dict:
        doc = self.live.document
        return {**doc.to_json(key_ids=True), **doc.stamp_json(),
                "live_settings": {section: list(checks) for section, checks in LIVE_SETTINGS.items()}}


def _bad_request(field: str, message: str) -> web.Response:
    return web.json_response(error_body(400, message, field, "invalid_setting"), status=400)


async def start_live_settings(app: web.Application, keys, keys_file: str) -> RouterLiveSettings:
    """Build the router's live settings from the environment, add the admin routes to
    ``app`` (before it starts) and close the bus when ``app`` is cleaned up."""
    from services.router.live_settings import LiveOptions

    live = RouterLiveSettings(keys, keys_file, LiveOptions.from_environ())
    AdminRoutes(live).register(app)
    await live.start()

    async def close(_app: web.Application) -> None:
        await live.stop()

    app.on_cleanup.append(close)
    return live
