from __future__ import annotations

import json
import logging

from outbox.logs import JsonFormatter


def record(msg: str, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("settled.test", logging.INFO, __file__, 1, msg, (), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_log_line_is_json_with_the_operations_identity() -> None:
    line = json.loads(
        JsonFormatter().format(record("attempt recorded", operation_id=7, state="unknown"))
    )
    assert line["msg"] == "attempt recorded"
    assert (line["operation_id"], line["state"], line["level"]) == (7, "unknown", "info")


def test_payee_params_and_secrets_never_reach_the_log() -> None:
    text = JsonFormatter().format(
        record(
            "oops",
            payee="P-secret-payee",
            params={"payee": "P-secret-payee"},
            api_key="sk_live_abc",
            operation_id=1,
        )
    )
    assert "P-secret-payee" not in text
    assert "sk_live_abc" not in text
    assert json.loads(text)["operation_id"] == 1


def test_exception_text_is_not_logged_only_its_type() -> None:
    try:
        raise ValueError("payee P-secret-payee")
    except ValueError:
        import sys

        rec = record("failed")
        rec.exc_info = sys.exc_info()
    text = JsonFormatter().format(rec)
    assert "P-secret-payee" not in text
    assert json.loads(text)["error"] == "ValueError"
