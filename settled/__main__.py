"""``python -m settled``: the ``settled`` command line."""

from settled.cli import main

main()
