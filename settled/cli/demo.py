"""``settled demo``: the embedded demo (``settled.demo``)."""

from __future__ import annotations

import click

from settled.cli.common import TEXT


@click.command()
@click.option("--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True)
@click.option("--keep", default=None, type=TEXT, help="keep the demo's files in this folder")
@click.option("--stripe", is_flag=True, help="send refunds through the Stripe gateway")
@click.option(
    "--provider",
    type=click.Choice(["http", "stripe", "wechatpay", "alipay"]),
    default="http",
    show_default=True,
    help="the gateway refunds go through, to the simulator's mode of it",
)
def demo(lang: str, keep: str | None, stripe: bool, provider: str) -> None:
    """Play the cases a payment team meets, on the embedded default (nothing to install)."""
    from settled.demo import run_demo

    raise SystemExit(
        run_demo(lang=lang, keep=keep, echo=click.echo, stripe=stripe, provider=provider)
    )
