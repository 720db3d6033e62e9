"""The ``weft`` command line: one module per command group, each a ``register_<name>``
function (``commands.py`` lists them). Commands import what they run inside their
handlers, so ``weft --help`` and the mesh commands never load torch.

``main`` is re-exported here because it is the console script's entry point
(``weft = "weft.cli:main"``) and ``python -m weft``'s.
"""
from weft.cli.commands import main

__all__ = ["main"]
