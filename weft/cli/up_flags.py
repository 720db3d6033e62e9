"""``weft up``'s flags for the services' settings (policies, pool, quotas, ...) and their
``weft ps`` listing: argparse glue over the table in ``weft/launcher/setting_flags.py``.

A flag not given is not passed at all (the service keeps its default, or a ``WEFT_*``
variable already in the environment), so ``weft up`` with no flags runs exactly the
services' defaults.
"""
from __future__ import annotations

import argparse

from weft.launcher.setting_flags import FLAGS, GROUPS


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One --help section per concern, every flag with its service, variable and default."""
    sections = {g: parser.add_argument_group(f"settings: {g}")
                for g in GROUPS}
    for f in FLAGS:
        group = sections[f.group]
        if f.boolean:
            group.add_argument(f.flag, dest=f.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=f.describe())
        else:
            group.add_argument(f.flag, dest=f.dest, default=None, choices=f.choices or None,
                               metavar=None if f.choices else (f.metavar or "VALUE"), help=f.describe())


def settings_from_args(args: argparse.Namespace) -> dict[str, str]:
    """dest -> value text of the setting flags given on the command line."""
    out: dict[str, str] = {}
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value is not None:
            out[f.dest] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out


def settings_lines(settings: dict[str, dict[str, str]]) -> list[str]:
    """``weft ps``'s listing of the non-default settings, one ``service flag value`` row each."""
    if not settings:
        return ["settings: all defaults"]
    rows = [(service, flag, value) for service, flags in sorted(settings.items()) for flag, value in flags.items()]
    width = max(len(r[0]) for r in rows)
    flag_width = max(len(r[1]) for r in rows)
    return ["settings (not the default):"] + [f"  {s.ljust(width)}  {f.ljust(flag_width)}  {v}" for s, f, v in rows]
