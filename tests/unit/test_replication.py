"""When a primary's replication is asynchronous, and how a start line says it
(``outbox.storage.replication.Replication``); the hosts of a multi-host database URL
(``outbox.db``). A real primary and standby: tests/integration/test_replication.py."""

from __future__ import annotations

import pytest

from outbox.db import database_hosts, hosts_in_query
from outbox.settings import Settings
from outbox.storage.replication import Replication, Standby


def primary(commit: str, names: str, *modes: str | None) -> Replication:
    standbys = tuple(Standby(f"s{n}", "streaming", mode) for n, mode in enumerate(modes, 1))
    return Replication(False, commit, names, standbys)


@pytest.mark.parametrize(
    ("replication", "asynchronous"),
    [
        (primary("on", ""), False),  # no standby: nothing to fail over to
        (primary("on", "", "async"), True),
        (primary("on", "s1", "sync", "async"), False),
        (primary("on", "ANY 1 (s1, s2)", "quorum", "quorum"), False),
        (primary("remote_apply", "s1", "sync"), False),
        (primary("on", "FIRST 1 (s1, s2)", "sync", "potential"), False),
        (primary("local", "s1", "sync"), True),  # commits do not wait for it
        (primary("off", "s1", "sync"), True),
        (primary("on", "", None), False),  # modes not visible to the role: not claimed
    ],
)
def test_asynchronous_when_standbys_stream_and_no_commit_waits_for_one(
    replication: Replication, asynchronous: bool
) -> None:
    assert replication.asynchronous is asynchronous


def test_the_start_lines_phrase_names_the_settings_and_each_standby() -> None:
    assert primary("on", "").describe() == (
        "synchronous_commit on, synchronous_standby_names '', no standbys"
    )
    catching_up = Replication(False, "on", "s1", (Standby("s1", "catchup", "potential"),))
    assert catching_up.describe() == (
        "synchronous_commit on, synchronous_standby_names 's1', standbys s1 potential (catchup)"
    )
    assert (
        primary("on", "", None)
        .describe()
        .endswith("standbys s1 mode not visible (grant pg_monitor)")
    )


@pytest.mark.parametrize(
    ("url", "read", "hosts"),
    [
        (
            "postgresql://u:pw@h1:5432,h2:5433/db?target_session_attrs=read-write",
            "postgresql://u:pw@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
            [("h1", 5432), ("h2", 5433)],
        ),
        (
            "postgresql+psycopg://u@/db?host=h1:5432&host=h2",
            "postgresql+psycopg://u@/db?host=h1:5432&host=h2",
            [("h1", 5432), ("h2", None)],
        ),
        (
            "postgresql://u@/db?host=h1,h2&port=5432,5433",
            "postgresql://u@/db?host=h1,h2&port=5432,5433",
            [("h1", 5432), ("h2", 5433)],
        ),
        ("postgresql://u@h1/db", "postgresql://u@h1/db", [("h1", None)]),
        ("sqlite:///settled.sqlite3", "sqlite:///settled.sqlite3", []),
    ],
    ids=["libpq", "query", "query_lists", "one_host", "sqlite"],
)
def test_a_multi_host_url_is_read_as_sqlalchemy_reads_it_with_each_host(
    url: str, read: str, hosts: list[tuple[str, int | None]]
) -> None:
    assert hosts_in_query(url) == read
    assert database_hosts(url) == hosts


def test_the_settings_read_libpqs_multi_host_url() -> None:
    settings = Settings(database_url="postgresql://u@h1:5432,h2:5433/db")
    assert settings.database_url == "postgresql://u@/db?host=h1:5432&host=h2:5433"
