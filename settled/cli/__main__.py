"""``python -m settled.cli``: the ``settled`` command line (how ``settled run``, the demo and the
tests start it)."""

from settled.cli import main

if __name__ == "__main__":
    main(prog_name="settled")
