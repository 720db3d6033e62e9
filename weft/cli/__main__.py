"""``python -m weft.cli``: the same command line as ``python -m weft`` (as when the CLI was one module)."""
import sys

from weft.cli.commands import main

sys.exit(main())
