"""NATS credentials and permissions: who may publish and subscribe to which subject.

NATS carries hints (membership, load, kv), but a heartbeat decides where requests go: an
open server lets anyone announce ``executor-0`` at its own address. So the server runs
with one user per *role* and an allow list per user (nats-server ``authorization`` block):

    role        publishes                                   subscribes
    executor    weft.heartbeat.>  weft.load.>  weft.kv.>     weft.settings.>
                weft.settingswant.>
    scheduler   weft.settingswant.>                         weft.heartbeat.>  weft.load.>  weft.kv.>
                                                            weft.settings.>
    cachestore  weft.kv.<its name> (default ``cachestore``)  nothing
    router      weft.settings.>  (live settings)            weft.routersettings.>
                weft.routersettings.>  (the whole document,  weft.settingswant.>
                keys included, for the other routers)

``weft.settingswant`` is a follower asking the routers to publish the live settings now
(it has just connected); its body is never read, and a router answers at most a few times
a second however many ask, so the right to publish there is the right to make routers
publish sooner, nothing more.

Nothing uses request/reply, so no role gets ``_INBOX.>``. The bus (nats_bus.py) drops an
event whose header names a source other than its subject's, so the right to publish on
``weft.kv.cachestore`` is the right to speak as ``cachestore`` and nothing more.

Passwords. The server side reads one variable per role, ``WEFT_NATS_<ROLE>_PASSWORD``
(the rendered config refers to them as ``$WEFT_NATS_EXECUTOR_PASSWORD``…, so the same
file serves ``weft up`` and Compose, and holds no secret). A service reads only its own:
``WEFT_NATS_USER`` (its role) and ``WEFT_NATS_PASSWORD`` (or ``WEFT_NATS_PASSWORD_FILE``,
for Docker secrets); credentials inside ``WEFT_NATS_URL`` (``nats://user:pw@host:port``)
work too, and logs print the URL redacted. ``derive_passwords(master)`` makes all four
from one secret (HMAC-SHA256, so knowing one role's password tells nothing about
another's): the launcher uses it with a random master per run; an operator can use it to
fill a ``.env`` (``python -m services.mesh.nats_auth env``). The mesh secret is *not*
used: every service holds it, and a router that knew the executor password could
publish heartbeats.

``nats.conf`` beside this module is ``render_config()`` (a test keeps them equal): the
Docker image ships it at ``/opt/weft/services/mesh/nats.conf`` for Compose's nats
service; ``weft up`` may render its own (TLS, other cachestore names). Compose's
development fallbacks (``dev_fallback_password``) are public, and a bus logging in with
one warns, as with the mesh secret's fallback.

A password must start with a letter and have 16+ characters: nats-server parses a
variable's value as a config value, and one that looks like a number stops the server.

TLS: with ``TlsFiles`` (the mesh's ``WEFT_MESH_TLS_CERT`` / ``_KEY`` / ``_CA``) the config
gets a ``tls`` block and the server requires TLS; clients (nats_bus.py) trust
``WEFT_MESH_TLS_CA`` and must name the server by a host in its certificate.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.mesh import mesh_auth

ROLES = ("executor", "scheduler", "cachestore", "router")
USER_ENV = "WEFT_NATS_USER"
PASSWORD_ENV = "WEFT_NATS_PASSWORD"
PASSWORD_FILE_ENV = "WEFT_NATS_PASSWORD_FILE"
MIN_PASSWORD_CHARS = 16
DEFAULT_CONFIG_PATH = Path(__file__).with_name("nats.conf")  # render_config(), checked in
_EVENT_KINDS = ("heartbeat", "load", "kv")  # subjects weft.<kind>.<source> (subjects.subject)
_SETTINGS_KIND = "settings"  # live_settings.BUS_KIND
_WANT_KIND = "settingswant"  # live_settings.WANT_KIND


def role_password_env(role: str) -> str:
    """The server-side variable holding ``role``'s password: ``WEFT_NATS_<ROLE>_PASSWORD``."""
    _check_role(role)
    return f"WEFT_NATS_{role.upper()}_PASSWORD"


@dataclass(frozen=True)
class Permissions:
    """Subjects a role may publish / subscribe to (empty: none at all)."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()


def role_permissions(cachestore_sources: tuple[str, ...] = ("cachestore",)) -> dict[str, Permissions]:
    """The table in the module docstring. ``cachestore_sources``: the cachestores'
    ``--name``s (their kv subjects)."""
    events = tuple(f"weft.{kind}.>" for kind in _EVENT_KINDS)
    # The live-settings document (live_settings.py): the router alone writes it, so the
    # right to publish there is the right to reconfigure the mesh.
    settings = (f"weft.{_SETTINGS_KIND}.>",)
    # Routers also share the whole document, API keys included, among themselves (the
    # newest wins across replicas): a subject no other role may read.
    routers = ("weft.routersettings.>",)
    # A follower that has just connected asks for the document (its body is never read).
    wants = (f"weft.{_WANT_KIND}.>",)
    return {
        "executor": Permissions(publish=events + wants, subscribe=settings),
        "scheduler": Permissions(publish=wants, subscribe=events + settings),
        "cachestore": Permissions(publish=tuple(f"weft.kv.{name}" for name in cachestore_sources)),
        "router": Permissions(publish=settings + routers, subscribe=routers + wants),
    }


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the NATS server's certificate (and the CA its clients use)."""

    cert_path: str
    key_path: str
    ca_path: str = ""

    @classmethod
    def from_mesh(cls, security) -> TlsFiles | None:
        """The mesh's TLS files (``mesh_auth.MeshSecurity``), or None when it has no certificate."""
        if not security.tls_cert_path:
            return None
        return cls(security.tls_cert_path, security.tls_key_path, security.tls_ca_path)


def render_config(permissions: Mapping[str, Permissions] | None = None, tls: TlsFiles | None = None) -> str:
    """A nats-server config (``nats-server -c FILE``) with one user per role whose password
    is ``$WEFT_NATS_<ROLE>_PASSWORD`` (resolved by the server from its environment; a
    missing one stops it at start). Listen address and ports stay command-line flags."""
    permissions = role_permissions() if permissions is None else permissions
    lines = ["# Weft NATS users: one per role (services/mesh/nats_auth.py). Generated; do not edit.",
             "authorization {", "  users = ["]
    for role, perm in permissions.items():
        lines.append(f"    {{user: {json.dumps(role)}, password: ${role_password_env(role)}, permissions: {{"
                     f"publish: {_rule(perm.publish)}, subscribe: {_rule(perm.subscribe)}}}}}")
    lines += ["  ]", "}"]
    if tls is not None:
        lines += ["tls {", f"  cert_file: {json.dumps(tls.cert_path)}", f"  key_file: {json.dumps(tls.key_path)}"]
        if tls.ca_path:
            lines.append(f"  ca_file: {json.dumps(tls.ca_path)}")
        lines += ["  timeout: 2", "}"]
    return "\n".join(lines) + "\n"


def _rule(subjects: tuple[str, ...]) -> str:
    # An allow list permits those only; an empty one would permit everything, so "none" is deny ">".
    return f"{{allow: {json.dumps(list(subjects))}}}" if subjects else '{deny: [">"]}'


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(ROLES)}")


def check_password(password: str, what: str) -> str:
    """``password`` if nats-server can take it from a variable; ValueError naming ``what``."""
    if len(password) < MIN_PASSWORD_CHARS or not password[:1].isascii() or not password[:1].isalpha():
        raise ValueError(f"{what}: a NATS password must start with a letter and have at least "
                         f"{MIN_PASSWORD_CHARS} characters")
    return password


def derive_passwords(master: str) -> dict[str, str]:
    """One password per role from ``master``: ``"wn" + hex(HMAC-SHA256(master, role))``."""
    if not master:
        raise ValueError("an empty master secret derives guessable NATS passwords")
    return {role: "wn" + hmac.new(master.encode(), f"weft-nats-password/v1/{role}".encode(),
                                  hashlib.sha256).hexdigest() for role in ROLES}


def dev_fallback_password(role: str) -> str:
    """Compose's public default for ``role`` when its variable is unset (warned about)."""
    _check_role(role)
    return f"weft-dev-nats-{role}-change-me"


def random_passwords() -> dict[str, str]:
    """Fresh random passwords, one per role (the launcher's default per run)."""
    return derive_passwords(secrets.token_hex(32))


def server_env(passwords: Mapping[str, str]) -> dict[str, str]:
    """The nats-server process's variables: ``WEFT_NATS_<ROLE>_PASSWORD`` for each role."""
    return {role_password_env(role): check_password(pw, role_password_env(role)) for role, pw in passwords.items()}


def client_env(role: str, passwords: Mapping[str, str]) -> dict[str, str]:
    """A service's variables: its role as the user and that role's password only."""
    _check_role(role)
    return {USER_ENV: role, PASSWORD_ENV: passwords[role]}


@dataclass(frozen=True)
class ClientAuth:
    """How one service logs in to NATS (empty user: anonymous)."""

    user: str = ""
    password: str = ""

    def __repr__(self) -> str:  # never print the password
        return f"ClientAuth(user={self.user!r}, password={'***' if self.password else ''!r})"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ClientAuth:
        """``WEFT_NATS_USER`` + ``WEFT_NATS_PASSWORD`` (or ``WEFT_NATS_PASSWORD_FILE``).
        ValueError naming the variable for a half-given pair, both password forms, or an
        unreadable / empty file."""
        env = os.environ if environ is None else environ
        user, password, path = env.get(USER_ENV, ""), env.get(PASSWORD_ENV, ""), env.get(PASSWORD_FILE_ENV, "")
        if password and path:
            raise ValueError(f"set either {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, not both")
        if path:
            try:
                password = Path(path).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"{PASSWORD_FILE_ENV}: cannot read {path}: {exc}") from None
            if not password:
                raise ValueError(f"{PASSWORD_FILE_ENV}: {path} is empty")
        if bool(user) != bool(password):
            raise ValueError(f"{USER_ENV} and {PASSWORD_ENV} must be given together")
        return cls(user, password)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redact(text: str, *secrets_: str) -> str:
    """``text`` with every non-empty ``secrets_`` replaced by ``***``."""
    for s in secrets_:
        if s:
            text = text.replace(s, "***")
    return text


class NatsLoginRefused(RuntimeError):
    """NATS refused this service's credentials: a configuration error (services exit
    EXIT_CONFIG, which supervisors do not restart), never an outage."""


def is_authorization_error(error: str) -> bool:
    return "authorization" in error.lower()


def mesh_tls_context() -> ssl.SSLContext | None:
    """Trust the mesh CA (``WEFT_MESH_TLS_CA``, else its certificate) for a NATS server
    that requires TLS; None: nats-py's default (system CAs), used only if it does."""
    security = mesh_auth.current()
    if not security.client_tls:
        return None
    return ssl.create_default_context(cafile=security.tls_ca_path or security.tls_cert_path)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.mesh.nats_auth config`` prints the server config;
    ``… env [MASTER]`` prints ``WEFT_NATS_<ROLE>_PASSWORD=…`` lines for a Compose ``.env``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m services.mesh.nats_auth",
        description="NATS users and passwords of a Weft mesh: one login per role (executor, scheduler, "
                    "cachestore, router) with per-role publish/subscribe permissions.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("config", help="print the nats-server users file (passwords are $VAR references: "
                                       "no secret in it); what services/mesh/nats.conf holds")
    env = commands.add_parser("env", help="print WEFT_NATS_<ROLE>_PASSWORD=... lines for a Compose .env file")
    env.add_argument("master", nargs="?", default=None,
                     help="derive the four passwords from this secret (HMAC per role); default: "
                          "$WEFT_NATS_SECRET, else fresh random passwords")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "config":
        sys.stdout.write(render_config())
        return 0
    master = args.master if args.master is not None else os.environ.get("WEFT_NATS_SECRET", "")
    for key, value in server_env(derive_passwords(master) if master else random_passwords()).items():
        sys.stdout.write(f"{key}={value}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
