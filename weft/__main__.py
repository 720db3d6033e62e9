"""``python -m weft``: the weft command line."""
import sys

from weft.cli import main

sys.exit(main())
