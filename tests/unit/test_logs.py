from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from outbox import logs
from outbox.errors import InvalidInput
from outbox.logs import JsonFormatter, TextFormatter


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
        rec = record("failed")
        rec.exc_info = sys.exc_info()
    for formatter in (JsonFormatter(), TextFormatter()):
        text = formatter.format(rec)
        assert "P-secret-payee" not in text
        assert "ValueError" in text
    assert json.loads(JsonFormatter().format(rec))["error"] == "ValueError"


def test_bound_fields_reach_lines_inside_only_and_pass_the_allow_list() -> None:
    with logs.bound(tenant="acme", op_id="op-1", kind="refund", payee="P-secret-payee"):
        inside = json.loads(JsonFormatter().format(record("sending", attempt=2)))
    outside = json.loads(JsonFormatter().format(record("idle")))
    assert (inside["tenant"], inside["op_id"], inside["kind"], inside["attempt"]) == (
        "acme",
        "op-1",
        "refund",
        2,
    )
    assert "payee" not in inside
    assert "tenant" not in outside


def test_a_line_naming_a_remembered_operation_carries_its_identity() -> None:
    logs.remember(4242, tenant="acme", op_id="op-42", kind="refund")
    line = json.loads(JsonFormatter().format(record("attempt recorded", operation_id=4242)))
    assert (line["tenant"], line["op_id"], line["kind"]) == ("acme", "op-42", "refund")
    # the line's own fields win over what was remembered
    own = json.loads(JsonFormatter().format(record("x", operation_id=4242, tenant="other")))
    assert own["tenant"] == "other"


def test_remembered_identities_are_bounded() -> None:
    table = logs._Identities(size=2)
    for n in range(3):
        table.remember(n, tenant="t", op_id=f"op-{n}", kind="refund")
    assert table.get(0) == {}
    assert table.get(2)["op_id"] == "op-2"


def test_structured_values_become_text_never_nested_objects() -> None:
    line = json.loads(JsonFormatter().format(record("pass", outcomes={"found": 2})))
    assert line["outcomes"] == "{'found': 2}"


def test_text_lines_carry_the_same_fields_as_keys() -> None:
    text = TextFormatter().format(record("attempt recorded", operation_id=7, duration_ms=12.5))
    assert " INFO settled.test: attempt recorded" in text
    assert "operation_id=7" in text
    assert "duration_ms=12.5" in text


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``configure`` changes process-wide loggers: put them back afterwards."""
    names = ["", "py.warnings", *logs._ADOPTED, *logs.QUIETED, *logs.SILENCED]
    loggers = [logging.getLogger(name) for name in names]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        logging.captureWarnings(False)


@pytest.mark.usefixtures("root_logging")
def test_configure_reads_level_and_format_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SETTLED_LOG_LEVEL", "warning")
    monkeypatch.setenv("SETTLED_LOG_FORMAT", "text")
    logs.configure()
    root = logging.getLogger()
    assert root.level == logging.WARNING
    assert isinstance(root.handlers[0].formatter, TextFormatter)
    monkeypatch.delenv("SETTLED_LOG_FORMAT")
    logs.configure("DEBUG")
    assert root.level == logging.DEBUG
    assert isinstance(root.handlers[0].formatter, JsonFormatter)  # the default format


@pytest.mark.usefixtures("root_logging")
def test_uvicorn_lines_go_through_our_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(logging.StreamHandler(io.StringIO()))  # as uvicorn's config does
    uvicorn_error.propagate = False
    logs.configure("INFO", "json")
    uvicorn_error.info("Started server process")
    assert json.loads(stream.getvalue())["logger"] == "uvicorn.error"


@pytest.mark.parametrize(
    ("variable", "value"), [("SETTLED_LOG_LEVEL", "LOUD"), ("SETTLED_LOG_FORMAT", "xml")]
)
def test_a_bad_log_setting_is_refused_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        logs.from_environment({variable: value})
    assert caught.value.code == "invalid_setting"
    assert variable in caught.value.message
    assert value not in caught.value.message


@pytest.mark.usefixtures("root_logging")
def test_a_commands_default_level_gives_way_to_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SETTLED_LOG_LEVEL", raising=False)
    logs.configure(default_level="WARNING")
    assert logging.getLogger().level == logging.WARNING
    monkeypatch.setenv("SETTLED_LOG_LEVEL", "INFO")
    logs.configure(default_level="WARNING")
    assert logging.getLogger().level == logging.INFO


SECRET_LINES = {
    # what each library writes when it is heard: an order id, an amount, a payee
    "stripe": "message='Post details' post_data=amount=10000&metadata[order_id]=A1042&payee=P-7",
    "httpx": 'HTTP Request: GET http://sim/v1/refunds?payment_intent=pi_A1042 "HTTP/1.1 200 OK"',
    "httpcore.http11": "send_request_body.started request=<Request [b'POST']> A1042",
    "urllib3.connectionpool": 'https://api.stripe.com:443 "GET /v1/refunds?pi_A1042 HTTP/1.1"',
    "sqlalchemy.engine.Engine": "[generated] {'payee': 'P-7', 'amount_minor': 10000}",
    "kombu.transport": "message body {'order_id': 'A1042'}",
    "mcp.server.lowlevel.server": "Received request {'payee': 'P-7'}",
    "uvicorn.access": '127.0.0.1:51234 - "GET /v1/runs/x?order=A1042 HTTP/1.1" 200',
    "some.other.library": "payload payee=P-7",
}


@pytest.mark.usefixtures("root_logging")
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_no_other_library_writes_what_it_was_given(
    monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure(level, "json")
    for name, message in SECRET_LINES.items():
        logging.getLogger(name).info(message)
        logging.getLogger(name).debug(message)
    logging.getLogger("stripe").warning("Stripe v1 API error received error_message=A1042")
    logging.getLogger("settled.test").info("ours", extra={"operation_id": 1})
    logging.getLogger("celery.worker.consumer.connection").info("Connected to redis://x//")
    written = stream.getvalue()
    for secret in ("A1042", "P-7", "10000"):
        assert secret not in written
    names = [json.loads(line)["logger"] for line in written.splitlines()]
    assert names == ["settled.test", "celery.worker.consumer.connection"]


@pytest.mark.usefixtures("root_logging")
def test_another_librarys_warning_is_still_heard(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure("INFO", "json")
    logging.getLogger("kombu.connection").warning("connection lost")
    logging.getLogger("some.other.library").error("failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["logger"], line["level"]) for line in lines] == [
        ("kombu.connection", "warning"),
        ("some.other.library", "error"),
    ]


def test_sqlalchemy_errors_never_carry_a_statements_parameters() -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    from outbox.db import make_engine

    engine = make_engine("sqlite://")
    with pytest.raises(SQLAlchemyError) as caught, engine.begin() as conn:
        conn.execute(text("INSERT INTO missing (payee) VALUES (:payee)"), {"payee": "P-7"})
    assert "P-7" not in str(caught.value)
    engine.dispose()
