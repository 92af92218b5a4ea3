-- Hand-written PostgreSQL statements, loaded by name (``outbox.storage.postgres.QUERIES``).
-- Each starts with a "-- name: <name>" line; its comment lines say what it does. Static SQL:
-- values come only as bound parameters (":name").

-- name: write_transitions
-- A batch of transitions in one statement, atomic by itself (the executor's hot path: an
-- autocommit connection runs it). :rows is a JSON array with one object per transition
-- (``outbox.storage.postgres._row``); :actor is the writer.
-- The UPDATE is fenced row by row: the operation must still be in from_state and, under a
-- claim (lease_version given), at the claim's lease version; outside any claim (lease_version
-- null) the version is bumped, so that no lease holder can write after it. Everything else
-- (the event row, the review item opened or settled, the attempt started or finished) is
-- written for the rows the UPDATE changed only. JSON columns travel as text and are cast, so
-- a JSON null stays a JSON null, as SQLAlchemy's JSON type writes it.
WITH v AS (
    SELECT *
    FROM json_to_recordset(CAST(:rows AS json)) AS v(
        id bigint, lease_version integer, from_state text, to_state text, reason text,
        next_attempt_at timestamptz, due_now boolean, receipt text, downstream_ref text,
        looked boolean, release boolean, start boolean,
        note text, evidence text, review text, review_evidence text, resolution text,
        number integer, proof text, status_code integer, detail text
    )
),
m AS (
    UPDATE operations AS o
    SET state = v.to_state,
        reason = v.reason,
        next_attempt_at = CASE
            WHEN v.due_now THEN clock_timestamp()
            ELSE coalesce(v.next_attempt_at, o.next_attempt_at)
        END,
        receipt = CASE WHEN v.receipt IS NULL THEN o.receipt ELSE CAST(v.receipt AS json) END,
        downstream_ref = CASE WHEN v.receipt IS NULL THEN o.downstream_ref ELSE v.downstream_ref END,
        lookups = CASE WHEN v.looked THEN o.lookups + 1 ELSE o.lookups END,
        unknown_since = CASE
            WHEN v.to_state = 'unknown' AND v.from_state <> 'unknown' THEN clock_timestamp()
            ELSE o.unknown_since
        END,
        attempts = CASE WHEN v.start THEN o.attempts + 1 ELSE o.attempts END,
        first_sent_at = CASE
            WHEN v.start THEN coalesce(o.first_sent_at, clock_timestamp())
            ELSE o.first_sent_at
        END,
        lease_owner = CASE WHEN v.release THEN NULL ELSE o.lease_owner END,
        lease_until = CASE WHEN v.release THEN NULL ELSE o.lease_until END,
        lease_version = CASE
            WHEN v.lease_version IS NULL THEN o.lease_version + 1
            ELSE o.lease_version
        END,
        updated_at = clock_timestamp()
    FROM v
    WHERE o.id = v.id
      AND o.state = v.from_state
      AND (v.lease_version IS NULL OR o.lease_version = v.lease_version)
    RETURNING o.id, o.tenant, o.lease_version, o.lease_until
),
e AS (
    INSERT INTO operation_events
        (operation_id, from_state, to_state, actor, lease_version, reason, evidence, at)
    SELECT v.id, v.from_state, v.to_state, :actor, m.lease_version, v.note,
           CAST(v.evidence AS json), clock_timestamp()
    FROM v JOIN m ON m.id = v.id
),
r AS (
    -- at most one open item per operation (a partial unique index)
    INSERT INTO review_items (operation_id, tenant, reason, evidence, version, created_at)
    SELECT v.id, m.tenant, v.review, CAST(v.review_evidence AS json), 1, clock_timestamp()
    FROM v JOIN m ON m.id = v.id
    WHERE v.review IS NOT NULL
    ON CONFLICT (operation_id) WHERE resolved_at IS NULL DO NOTHING
),
c AS (
    -- an operation leaving unknown takes its open review item with it (the operation row
    -- first, then the item: the one lock order)
    UPDATE review_items AS i
    SET resolved_at = clock_timestamp(), resolved_by = :actor,
        resolution = CAST(v.resolution AS json), version = i.version + 1
    FROM v JOIN m ON m.id = v.id
    WHERE v.resolution IS NOT NULL AND i.operation_id = v.id AND i.resolved_at IS NULL
),
a AS (
    -- a send's attempt row, bounded by the claim's lease end
    INSERT INTO attempts (operation_id, number, lease_version, worker, started_at, not_after)
    SELECT v.id, v.number, v.lease_version, :actor, clock_timestamp(), m.lease_until
    FROM v JOIN m ON m.id = v.id
    WHERE v.start
),
f AS (
    -- what came back for the attempt the transition ends
    UPDATE attempts AS a
    SET finished_at = clock_timestamp(), proof = v.proof, status_code = v.status_code,
        detail = CAST(v.detail AS json)
    FROM v JOIN m ON m.id = v.id
    WHERE v.proof IS NOT NULL
      AND a.operation_id = v.id AND a.number = v.number AND a.lease_version = v.lease_version
)
SELECT id FROM m
