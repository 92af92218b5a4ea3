"""The status API over a real database (PostgreSQL and SQLite): keys, tenants, reports."""

from __future__ import annotations

import secrets
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import StarletteDeprecationWarning

from outbox import runs
from outbox.apikeys import create_api_key, revoke_api_key
from outbox.intake import Outbox
from outbox.models import ApiKey, Operation, ReviewItem, Run
from settled.web import NOT_FOUND, UNAUTHORIZED, create_web_app
from tests.support.contend import contender, pausing
from tests.support.rig import GOOD
from tests.support.simtools import wait_until

with warnings.catch_warnings():
    # Starlette's TestClient would rather run on httpx2, which is not a dependency (yet); on
    # httpx it works the same, and warns once at import.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


@contextmanager
def serving(app: FastAPI) -> Iterator[httpx.Client]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port; a client for it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="the web server to start")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class Tenant:
    name: str
    key: str
    handle: str
    op_id: str


@dataclass
class Api:
    client: httpx.Client
    sessions: sessionmaker[Session]
    acme: Tenant
    globex: Tenant

    def get(self, path: str, key: str | None) -> tuple[int, dict[str, object]]:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        r = self.client.get(path, headers=headers)
        return r.status_code, r.json()

    def post(self, path: str, key: str | None) -> tuple[int, dict[str, object]]:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        r = self.client.post(path, headers=headers)
        return r.status_code, r.json()

    def state(self, op_id: str, tenant: str) -> str:
        with self.sessions() as s:
            return str(
                s.scalar(
                    select(Operation.state).where(
                        Operation.tenant == tenant, Operation.op_id == op_id
                    )
                )
            )


def make_tenant(sessions: sessionmaker[Session], outbox: Outbox, name: str) -> Tenant:
    with sessions.begin() as s:
        _, key = create_api_key(s, tenant=name)
        run = runs.open_run(s, tenant=name)
        outbox.enqueue(s, tenant=name, op_id=f"op-{name}-1", kind="refund", params=GOOD, run=run)
        sent = outbox.enqueue(
            s, tenant=name, op_id=f"op-{name}-2", kind="refund",
            params={**GOOD, "amount_minor": 5}, run=run,
        ).operation  # fmt: skip
        # As if a worker had sent it and the answer was lost.
        s.execute(update(Operation).where(Operation.id == sent.id).values(state="unknown"))
        return Tenant(name, key, run.handle, f"op-{name}-1")


@pytest.fixture
def api(engine: Engine, outbox: Outbox) -> Iterator[Api]:
    sessions = sessionmaker(engine, expire_on_commit=False)
    acme = make_tenant(sessions, outbox, "acme")
    globex = make_tenant(sessions, outbox, "globex")
    with serving(create_web_app(sessions)) as client:
        yield Api(client, sessions, acme, globex)


def endpoints(t: Tenant) -> list[tuple[str, str]]:
    return [
        ("GET", f"/v1/runs/{t.handle}"),
        ("GET", f"/v1/runs/{t.handle}?lang=zh"),
        ("POST", f"/v1/runs/{t.handle}/cancel"),
        ("GET", f"/v1/operations/{t.op_id}"),
    ]


def call(api: Api, method: str, path: str, key: str | None) -> tuple[int, dict[str, object]]:
    return api.get(path, key) if method == "GET" else api.post(path, key)


def test_cross_tenant_matrix_over_every_endpoint(api: Api) -> None:
    made_up = Tenant("nobody", "", runs.new_handle(), "op-nobody-1")
    for owner in (api.acme, api.globex):
        caller = api.globex if owner is api.acme else api.acme
        for (method, path), (_, missing) in zip(endpoints(owner), endpoints(made_up), strict=True):
            status, body = call(api, method, path, caller.key)
            assert (status, body) == (404, NOT_FOUND), (method, path)
            # Exactly what a handle or op_id that does not exist answers.
            assert call(api, method, missing, caller.key) == (status, body)
            for key in (None, "stk_0000000000000000_" + "A" * 43, caller.key + "x", "garbage"):
                assert call(api, method, path, key) == (401, UNAUTHORIZED), (method, key)
    # Nobody's run was cancelled by another tenant's attempts.
    for t in (api.acme, api.globex):
        assert api.state(t.op_id, t.name) == "planned"
        with api.sessions() as s:
            assert s.scalar(select(Run.cancel_requested_at).where(Run.handle == t.handle)) is None
    # And each tenant reaches its own.
    for t in (api.acme, api.globex):
        for method, path in endpoints(t):
            status, _ = call(api, method, path, t.key)
            assert status == 200, (t.name, method, path)


def test_unauthorized_answers_carry_a_bearer_challenge(api: Api) -> None:
    r = api.client.get(f"/v1/runs/{api.acme.handle}")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert api.acme.key not in r.text


def test_revoked_key_is_refused(api: Api) -> None:
    with api.sessions.begin() as s:
        key_id = s.scalar(select(ApiKey.key_id).where(ApiKey.tenant == "acme"))
        assert key_id is not None
        revoke_api_key(s, key_id)
    assert api.get(f"/v1/runs/{api.acme.handle}", api.acme.key) == (401, UNAUTHORIZED)


def test_keys_are_stored_hashed(api: Api) -> None:
    with api.sessions() as s:
        rows = list(s.scalars(select(ApiKey)))
    assert len(rows) == 2
    for row in rows:
        assert row.secret_hash not in (api.acme.key, api.globex.key)
        assert row.secret_hash not in api.acme.key + api.globex.key
        assert len(row.secret_hash) == 64


def test_enumerating_random_handles_yields_only_identical_404s(api: Api) -> None:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
    bodies = set()
    for i in range(200):
        if i % 2:
            handle = runs.new_handle()
        else:
            handle = "".join(secrets.choice(alphabet) for _ in range(1 + i % 50))
        r = api.client.get(
            f"/v1/runs/{handle}", headers={"Authorization": f"Bearer {api.acme.key}"}
        )
        assert r.status_code == 404, handle
        bodies.add(r.text)
    assert bodies == {api.client.get(
        f"/v1/runs/{api.globex.handle}", headers={"Authorization": f"Bearer {api.acme.key}"}
    ).text}  # fmt: skip


def test_report_in_english_and_chinese_through_http(api: Api) -> None:
    t = api.acme
    status, body = api.get(f"/v1/runs/{t.handle}?lang=en", t.key)
    assert status == 200
    assert body["cancelled"] is False
    assert body["counts"] == {"done": 0, "not_done": 1, "uncertain": 1}
    assert (
        "The result of operation op-acme-2 (refund of 0.05 CNY) is still pending confirmation."
        in str(body["text"])
    )

    status, cancelled = api.post(f"/v1/runs/{t.handle}/cancel?lang=en", t.key)
    assert status == 200
    assert (cancelled["cancelled_now"], cancelled["already_requested"]) == (1, False)
    assert api.state("op-acme-1", "acme") == "cancelled"
    assert api.state("op-acme-2", "acme") == "unknown"  # already sent: stays as it is

    status, en = api.get(f"/v1/runs/{t.handle}?lang=en", t.key)
    assert status == 200 and en["cancelled"] is True
    assert (
        "Stopped further processing, but the result of operation op-acme-2 (refund of 0.05 CNY) "
        "is still pending confirmation." in str(en["text"])
    )
    assert "Operation op-acme-1 (refund of 100.00 CNY) was cancelled before it was sent." in str(
        en["text"]
    )
    status, zh = api.get(f"/v1/runs/{t.handle}?lang=zh", t.key)
    assert status == 200
    assert "已停止继续处理，但操作 op-acme-2（refund，0.05 CNY）的结果仍待确认。" in str(zh["text"])
    assert "操作 op-acme-1（refund，100.00 CNY）在发送前已取消。" in str(zh["text"])
    (uncertain,) = zh["uncertain"]  # type: ignore[misc]
    assert uncertain["op_id"] == "op-acme-2"
    assert uncertain["text"].startswith(
        "已停止继续处理，但操作 op-acme-2（refund，0.05 CNY）的结果仍待确认。"
    )

    status, plain = api.get(f"/v1/runs/{t.handle}", t.key)
    assert status == 200 and "text" not in plain
    assert plain["counts"] == {"done": 0, "not_done": 1, "uncertain": 1}

    # Cancelling again changes nothing.
    status, again = api.post(f"/v1/runs/{t.handle}/cancel", t.key)
    assert (status, again["cancelled_now"], again["already_requested"]) == (200, 0, True)
    # The other tenant's identical run is untouched.
    assert api.state("op-globex-1", "globex") == "planned"


def test_a_cancel_through_the_api_holds_when_another_write_commits_meanwhile(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel reads (the key, the run), then writes; another task opens a run in between.
    On SQLite the answer was a 500 ("database is locked"), the run not cancelled."""

    def open_run() -> int:
        with api.sessions.begin() as s:
            return runs.open_run(s, tenant="acme").id

    with contender(open_run) as other:
        pausing(monkeypatch, runs, "request_run_cancel", other)
        status, body = api.post(f"/v1/runs/{api.acme.handle}/cancel", api.acme.key)
        other_id = other.result()
    assert (status, body["cancelled_now"], body["already_requested"]) == (200, 1, False)
    assert api.state("op-acme-1", "acme") == "cancelled"
    with api.sessions() as s:
        assert s.get(Run, other_id) is not None


def test_one_operation_by_op_id(api: Api) -> None:
    status, body = api.get("/v1/operations/op-acme-2", api.acme.key)
    assert status == 200
    assert (body["op_id"], body["state"], body["group"], body["run"]) == (
        "op-acme-2", "unknown", "uncertain", api.acme.handle,
    )  # fmt: skip
    assert "params" not in body and "P-7" not in str(body)  # no payee


#: far enough ahead that the reconciler's next look is past quiescence and review threshold
NEXT_LOOK = datetime(2099, 1, 1, 12, 0, tzinfo=UTC)


def test_an_uncertain_answer_says_what_it_waits_for_and_by_when(api: Api) -> None:
    """The next look is past quiescence and the review threshold, so it decides: the latest
    is that look, a beat period (10 s) and a lookup (10 s) later (the defaults)."""
    with api.sessions.begin() as s:
        s.execute(
            update(Operation)
            .where(Operation.op_id == "op-acme-2")
            .values(next_attempt_at=NEXT_LOOK)
        )
    status, op = api.get("/v1/operations/op-acme-2?lang=en", api.acme.key)
    assert status == 200
    assert op["evidence"]["waits_for"] == "quiescence"  # type: ignore[index]
    verdict_by = datetime.fromisoformat(op["evidence"]["verdict_by"])  # type: ignore[index]
    assert verdict_by == NEXT_LOOK + timedelta(seconds=20)
    assert "decided by 2099-01-01 12:00:20 UTC at the latest" in str(op["text"])
    status, zh = api.get(f"/v1/runs/{api.acme.handle}?lang=zh", api.acme.key)
    assert status == 200
    (line,) = zh["uncertain"]  # type: ignore[misc]
    assert line["evidence"]["verdict_by"] == op["evidence"]["verdict_by"]  # type: ignore[index]
    assert "最迟于 2099-01-01 12:00:20 UTC 得出结论" in line["text"]
    assert "最迟于 2099-01-01 12:00:20 UTC 得出结论" in str(zh["text"])
    status, plain = api.get("/v1/operations/op-acme-2", api.acme.key)
    assert "text" not in plain and plain["evidence"]["waits_for"] == "quiescence"  # type: ignore[index]


def test_an_operation_in_review_waits_for_staff_with_no_time(api: Api) -> None:
    with api.sessions.begin() as s:
        op = s.scalars(select(Operation).where(Operation.op_id == "op-acme-2")).one()
        s.add(ReviewItem(operation_id=op.id, tenant="acme", reason="x", evidence={}))
    status, body = api.get("/v1/operations/op-acme-2?lang=zh", api.acme.key)
    assert status == 200
    assert body["evidence"]["waits_for"] == "staff"  # type: ignore[index]
    assert body["evidence"]["verdict_by"] is None  # type: ignore[index]
    assert str(body["text"]).endswith("客服人员正在核查。客服人员核查完成前，无法承诺具体时间。")


def test_bad_language_is_a_typed_422(api: Api) -> None:
    status, body = api.get(f"/v1/runs/{api.acme.handle}?lang=fr", api.acme.key)
    assert status == 422
    assert body["error"]["code"] == "invalid_request"  # type: ignore[index]


def test_openapi_document_is_served(api: Api) -> None:
    r = api.client.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert set(doc["paths"]) == {
        "/v1/runs/{handle}",
        "/v1/runs/{handle}/cancel",
        "/v1/operations/{op_id}",
    }
    assert "HTTPBearer" in doc["components"]["securitySchemes"]
    assert "401" in doc["paths"]["/v1/runs/{handle}"]["get"]["responses"]


def test_unknown_route_is_a_json_404(api: Api) -> None:
    r = api.client.get("/v1/nothing", headers={"Authorization": f"Bearer {api.acme.key}"})
    assert (r.status_code, r.json()) == (404, NOT_FOUND)


def test_app_from_settings_builds_no_engine_until_called(sqlite: Engine) -> None:
    from outbox.settings import Settings

    app = create_web_app(Settings(database_url=str(sqlite.url)))
    with serving(app) as client:
        assert client.get("/v1/runs/x").status_code == 401


def test_health_and_metrics_need_no_key_and_follow_the_database(api: Api) -> None:
    health = api.client.get("/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    metrics = api.client.get("/metrics")
    assert metrics.status_code == 200
    lines = metrics.text.splitlines()
    # make_tenant left one operation of each tenant unknown and one planned
    assert 'settled_operations{state="unknown"} 2.0' in lines
    assert "settled_review_queue_depth 0.0" in lines


# -- bad input at the edge -------------------------------------------------------------------

MALFORMED = [
    "%00", "a%00b", "op-acme-1%00", "%00op-acme-1", "%C3%B3p-1", "op-%D9%A3", "%F0%9D%9F%98",
    "%FF", "%ED%A0%80", "op-acme-1%0A", "op-acme-1%20", "%20", "o" * 81, "op%22x", "op%27x",
]  # fmt: skip


@pytest.mark.parametrize("segment", MALFORMED)
def test_a_malformed_op_id_answers_exactly_as_an_unknown_one(api: Api, segment: str) -> None:
    unknown = api.client.get(
        "/v1/operations/op-unknown-1", headers={"Authorization": f"Bearer {api.acme.key}"}
    )
    r = api.client.get(
        f"/v1/operations/{segment}", headers={"Authorization": f"Bearer {api.acme.key}"}
    )
    assert (r.status_code, r.json()) == (404, NOT_FOUND)
    assert r.content == unknown.content


@pytest.mark.parametrize("template", ["/v1/runs/{}", "/v1/runs/{}/cancel", "/v1/runs/{}?lang=en"])
@pytest.mark.parametrize("mangle", ["{}%00", "%00{}", "{}%0A", "{}%C3%B3", "%ED%A0%80"])
def test_a_malformed_handle_answers_exactly_as_an_unknown_one(
    api: Api, template: str, mangle: str
) -> None:
    method = "POST" if "cancel" in template else "GET"
    path = template.format(mangle.format(api.acme.handle))
    assert call(api, method, path, api.acme.key) == (404, NOT_FOUND)
    assert api.state("op-acme-1", "acme") == "planned"  # nothing was cancelled


@dataclass
class Fuzzed:
    client: TestClient
    sessions: sessionmaker[Session]
    acme: Tenant
    globex: Tenant


@pytest.fixture
def fuzzed(engine: Engine, outbox: Outbox) -> Iterator[Fuzzed]:
    """The app in process (FastAPI's TestClient): a request costs no socket and no thread."""
    sessions = sessionmaker(engine, expire_on_commit=False)
    acme = make_tenant(sessions, outbox, "acme")
    globex = make_tenant(sessions, outbox, "globex")
    with TestClient(create_web_app(sessions), raise_server_exceptions=False) as client:
        yield Fuzzed(client, sessions, acme, globex)


API = ["/v1/runs/{}", "/v1/runs/{}/cancel", "/v1/operations/{}"]
ROUTES = [*API, *API, *API, "/v1/runs/{}/{}", "/v1/{}", "/{}", "/healthz", "/metrics"]
any_text = st.text(st.characters(exclude_categories=()), max_size=40)
printable = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
raw_bytes = st.binary(max_size=40)


def encoded(value: str | bytes) -> str:
    """``value`` percent-encoded, every byte of it (lone surrogates as their UTF-8-like bytes)."""
    return quote(value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value, "")


def segments(real: list[str]) -> st.SearchStrategy[str]:
    """Path segments: any text or bytes, odd escapes, or a real id with something around it
    (never a real id as it is: a cancel of a real run would be a legitimate write)."""
    around = st.builds(
        lambda r, before, after: before + r + after,
        st.sampled_from(real),
        st.text(st.characters(exclude_categories=()), min_size=1, max_size=5),
        any_text,
    )
    escapes = st.sampled_from(
        ["%00", "a%00b", "op-acme-1%00", "%ZZ", "%", "..", "%2F", "%F0%9D%9F%98", "%ED%A0%80"]
    )
    odd = st.one_of(any_text, raw_bytes, around).map(encoded)
    return st.booleans().flatmap(lambda b: escapes if b else odd)


HEADER_NAMES = [
    "authorization", "content-type", "content-length", "cookie", "accept", "accept-language",
    "x-forwarded-for", "host", "transfer-encoding", "x-custom",
]  # fmt: skip
query_pairs = st.tuples(
    st.sampled_from(["lang", "x"]) | printable,
    st.sampled_from(["en", "zh"]) | printable | raw_bytes,
).map(lambda kv: f"{encoded(kv[0])}={encoded(kv[1])}")


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_no_request_to_the_status_api_answers_5xx(fuzzed: Fuzzed, data: st.DataObject) -> None:
    acme, globex = fuzzed.acme, fuzzed.globex
    real = [acme.handle, acme.op_id, "op-acme-2", globex.handle, globex.op_id]
    route = data.draw(st.sampled_from(ROUTES), label="route")
    path = route.format(*(data.draw(segments(real)) for _ in range(route.count("{}"))))
    if route in ("/v1/runs/{}", "/v1/operations/{}") and data.draw(st.integers(0, 4)) == 0:
        path = route.format(data.draw(st.sampled_from(real)))  # a real one: read only
    query = data.draw(st.lists(query_pairs, max_size=3), label="query")
    # Mostly a valid key: without one, every API route stops at the 401.
    keys = st.sampled_from([acme.key, globex.key])
    others = st.none() | printable.map("Bearer {}".format)
    key = data.draw(st.integers(0, 4).flatmap(lambda i: others if i == 0 else keys), label="key")
    headers: list[tuple[bytes, bytes]] = []
    if key is not None:
        auth = key if key.startswith("Bearer ") else f"Bearer {key}"
        headers.append((b"authorization", auth.encode("utf-8", "surrogatepass")))
    extra = st.lists(st.tuples(st.sampled_from(HEADER_NAMES), raw_bytes), max_size=3)
    headers += [(name.encode(), value) for name, value in data.draw(extra, label="headers")]
    natural = st.just("POST" if route.endswith("/cancel") else "GET")
    odd = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
    method = data.draw(st.integers(0, 4).flatmap(lambda i: odd if i == 0 else natural))
    url = path + ("?" + "&".join(query) if query else "")

    response = fuzzed.client.request(method, url, headers=headers)

    assert response.status_code < 500, (method, url, headers, response.text)
    if response.status_code >= 400 and method != "HEAD":
        assert set(response.json()) == {"error"}
    with fuzzed.sessions() as s:  # nothing was written: no run cancelled, no state changed
        assert s.scalars(select(Run.cancel_requested_at)).all() == [None, None]
        assert sorted(s.scalars(select(Operation.state))) == [
            "planned", "planned", "unknown", "unknown"
        ]  # fmt: skip
