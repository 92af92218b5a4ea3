"""The live-traffic and open-loop benchmark's judgement and its options (``bench/``): a peer's
figure counts only when every refund had one effect and one receipt, and a bad option is
refused before anything runs."""

from __future__ import annotations

import pytest

from bench.phases.live import Judgement
from bench.pipeline import parse


def test_a_run_with_one_effect_and_one_receipt_per_refund_is_correct() -> None:
    judged = Judgement(refunds=10, effects=10, duplicated=0, receipts=10, missing=0, extra=0)
    assert judged.correct
    assert str(judged).endswith(": correct")


@pytest.mark.parametrize(
    "counts",
    [
        {"effects": 11, "duplicated": 1},  # a refund paid twice
        {"effects": 9, "receipts": 9, "missing": 1},  # a refund never done
        {"receipts": 11, "extra": 1},  # two receipts for one refund
        {"effects": 9},  # an effect short, however it is counted
    ],
)
def test_a_second_effect_a_missing_refund_or_a_second_receipt_is_not_correct(
    counts: dict[str, int],
) -> None:
    base = {"refunds": 10, "effects": 10, "duplicated": 0, "receipts": 10, "missing": 0, "extra": 0}
    judged = Judgement(**{**base, **counts})
    assert not judged.correct
    assert str(judged).endswith(": NOT correct")


def test_no_refund_at_all_is_not_correct() -> None:
    assert not Judgement(refunds=0, effects=0, duplicated=0, receipts=0, missing=0, extra=0).correct


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--peers", "kafka"], "unknown peer kafka; known: procrastinate, dbos"),
        (["--open-rates", "0"], "rates must be positive numbers"),
        (["--open-rates", "fast"], "not a list of rates"),
        (["--live-seconds", "0"], "--live-seconds and --open-seconds must be positive"),
    ],
)
def test_a_bad_option_is_refused_with_what_is_wrong(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_quick_sets_short_windows_and_an_option_given_wins() -> None:
    args = parse(["--quick", "--live-seconds", "7"])
    assert args.live_seconds == 7
    assert args.open_seconds == 3.0
    assert args.scan_large == 20000
    assert parse(["--peers", "procrastinate,dbos"]).peers == ["procrastinate", "dbos"]
