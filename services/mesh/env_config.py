"""Build a service's frozen config dataclass from flags and ``WEFT_`` environment variables.

Each config field declares its help text with ``option(...)``; ``load_config`` turns the
dataclass into an argparse parser whose ``--help`` explains every flag, its environment
variable and its default. Precedence: flag > environment > default. Validation lives in
the dataclass's ``__post_init__``; a ``ValueError`` there becomes a usage error naming
the setting (exit status 2).

Environment names: ``WEFT_<SERVICE>_<FIELD>`` (e.g. ``WEFT_EXECUTOR_PORT``), or
``WEFT_<FIELD>`` for settings shared by every service (``WEFT_NATS_URL``,
``WEFT_LOG_LEVEL``, ``WEFT_LOG_FORMAT``), declared with ``shared=True``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


def option(help: str, *, default: Any = dataclasses.MISSING, choices: Sequence[str] | None = None,
           shared: bool = False) -> Any:
    """A config field with its ``--help`` text. ``shared`` fields use ``WEFT_<FIELD>``."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "shared": shared}
    return dataclasses.field(default=default, metadata=meta)


def env_name(service: str, f: dataclasses.Field) -> str:
    prefix = "WEFT_" if f.metadata.get("shared") else f"WEFT_{service.upper()}_"
    return prefix + f.name.upper()


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation like ``int`` or ``int | None``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config annotation {hint!r}")
        return args[0], True
    return hint, False


def _parse(text: str, typ: type, optional: bool, where: str) -> Any:
    if optional and text.strip().lower() in _NONE:
        return None
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        return typ(text)
    except ValueError as exc:
        raise ValueError(f"{where}: cannot parse {text!r} as {typ.__name__} ({exc})") from None


def build_parser(cls: type, service: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser for ``cls`` whose help lists every flag with env name and default."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{service}",
        description=description,
        epilog="Every flag may also be set through the environment variable shown in its "
        "help; a flag given on the command line wins over the environment.",
    )
    for f in dataclasses.fields(cls):
        typ, optional = _base_type(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        shown = "none" if default is None else default
        help_text = f"{f.metadata.get('help', '')} [env {env_name(service, f)}; default: {shown}]"
        choices = f.metadata.get("choices")
        if typ is bool:
            parser.add_argument(flag_name(f), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(
                flag_name(f), dest=f.name, default=None, choices=choices, metavar=typ.__name__.upper() if not choices else None,
                type=(lambda s, t=typ, o=optional, n=flag_name(f): _flag_type(s, t, o, n)), help=help_text,
            )
    return parser


def _flag_type(text: str, typ: type, optional: bool, name: str) -> Any:
    try:
        return _parse(text, typ, optional, name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve(cls: type[T], service: str, flags: Mapping[str, Any], environ: Mapping[str, str]) -> T:
    """Construct ``cls`` from parsed flag values (None = not given) and the environment.
    Raises ValueError naming the offending setting."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        typ, optional = _base_type(hints[f.name])
        if flags.get(f.name) is not None:
            values[f.name] = flags[f.name]
            continue
        env = env_name(service, f)
        if env in environ:
            value = _parse(environ[env], typ, optional, env)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{env}: must be one of {list(choices)}, got {value!r}")
            values[f.name] = value
    return cls(**values)


def load_config(cls: type[T], service: str, description: str, argv: Sequence[str] | None = None,
                environ: Mapping[str, str] | None = None) -> T:
    """Parse ``argv`` and the environment into a validated ``cls``; exits 2 on bad input.

    A config with a ``mesh_secret_file`` field (every service's) also fixes the process's
    mesh security here (``mesh_auth.configure``), so a bad secret file or a secret given
    twice is the same usage error, naming the option, in every service."""
    parser = build_parser(cls, service, description)
    ns = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    try:
        config = resolve(cls, service, vars(ns), env)
        if hasattr(config, "mesh_secret_file"):
            from services.mesh import mesh_auth

            mesh_auth.configure(config.mesh_secret_file, env)
        return config
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def to_argv(config: Any) -> list[str]:
    """The flags that reproduce ``config`` (for launchers starting a service process)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            argv += [flag_name(f), "none"]
        else:
            argv += [flag_name(f), str(value)]
    return argv
