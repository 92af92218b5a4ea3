"""Procrastinate and DBOS, the peers behind ``--peers``: installed by the bench into an
environment of its own (``python -m venv`` and pip, by package name and pinned version), so
that the product never depends on them. Their modules (``procrastinate_peer``, ``dbos_peer``)
run with that environment's interpreter and import only it, the standard library and
``bench.peers.schema``."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from bench.peers.schema import NAMES
from bench.phases.live import System

#: peer → the requirements its environment installs (the versions the issue measured)
EXTERNAL_PEERS: dict[str, list[str]] = {
    "procrastinate": ["procrastinate==3.10.0", "psycopg[binary]>=3.1", "httpx>=0.27"],
    "dbos": ["dbos==3.4.0", "psycopg[binary]>=3.1", "httpx>=0.27"],
}

LABELS = {"procrastinate": "Procrastinate 3.10", "dbos": "DBOS 3.4"}


class PeerInstallError(RuntimeError):
    """The peers' environment could not be made."""


def prepare_peers(names: list[str], where: Path) -> list[System]:
    """One environment under ``where`` for the peers ``names`` (made once, then reused while
    its requirements stay the same); their ``System``s."""
    if not names:
        return []
    requirements = sorted({r for n in names for r in EXTERNAL_PEERS[n]})
    tag = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    venv = where / f"venv-{tag}"
    python = venv / "bin" / "python"
    marker = venv / "bench-installed"
    if not marker.exists():
        print(f"  installing the peers into {venv}: {' '.join(requirements)} ...", flush=True)
        where.mkdir(parents=True, exist_ok=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(python), "-m", "pip", "install", "--quiet", *requirements],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise PeerInstallError(
                    f"installing the peers failed ({' '.join(step[:4])} ...):\n"
                    f"{done.stderr[-2000:]}"
                )
        marker.write_text("\n".join(requirements) + "\n")
    return [System(n, LABELS[n], python=str(python), peer=NAMES[n]) for n in names]
