"""A running instance: what the state file records of it (``Instance``) and the live
process behind it. The launcher's process table maps instance names to these; the
supervision and ``weft chaos`` read it."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weft.launcher.mesh_state import Instance


@dataclass
class Running:
    instance: Instance
    process: asyncio.subprocess.Process
