"""``settled demo``: the embedded demo (``settled.demo``)."""

from __future__ import annotations

import click

from settled.cli.common import TEXT


@click.command()
@click.option("--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True)
@click.option("--keep", default=None, type=TEXT, help="keep the demo's files in this folder")
def demo(lang: str, keep: str | None) -> None:
    """Play the cases a payment team meets, on the embedded default (nothing to install)."""
    from settled.demo import run_demo

    raise SystemExit(run_demo(lang=lang, keep=keep, echo=click.echo))
