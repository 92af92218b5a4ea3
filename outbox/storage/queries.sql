-- Hand-written PostgreSQL statements, loaded by name (``outbox.storage.postgres``).
-- Each starts with a "-- name: <name>" line; its comment lines say what it does. Static SQL:
-- values come only as bound parameters (":name"), never formatted into the text.

-- name: write_transitions
-- A batch of transitions in one statement, atomic by itself (the executor's hot path: an
-- autocommit connection runs it). :rows is a JSON array with one object per transition
-- (``outbox.storage.postgres._row``), :ids their operations' ids; :actor is the writer.
-- Returns the ids written.
-- The UPDATE is fenced row by row: the operation must still be in from_state and, under a
-- claim (lease_version given), at the claim's lease version; outside any claim (lease_version
-- null) the version is bumped, so that no lease holder can write after it. Each row's event
-- is written for the rows the UPDATE changed only, and so is what the parts below write
-- (review items opened and settled, attempts started and finished): a part is added to the
-- statement, between the event rows and the final SELECT, only for a batch that needs it
-- (each part is a data-modifying statement that costs even when it writes nothing). JSON
-- columns travel as text and are cast, so a JSON null stays a JSON null, as SQLAlchemy's JSON
-- type writes it.
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
      -- the rows' ids again, as an array: the planner reads the operations by their primary
      -- key. Without it, it plans for json_to_recordset's 100 rows and, on a table of a few
      -- thousand, hashes a sequential scan of the whole table (2.7 ms for one row at 2,150
      -- rows; 0.3 ms with it).
      AND o.id = ANY(CAST(:ids AS bigint[]))
    -- what the parts below need of each row written (no second join with v)
    RETURNING o.id, o.tenant, o.lease_version, o.lease_until, v.lease_version AS fence,
              v.from_state, v.to_state, v.note, v.evidence, v.review, v.review_evidence,
              v.resolution, v.start, v.number, v.proof, v.status_code, v.detail
),
e AS (
    INSERT INTO operation_events
        (operation_id, from_state, to_state, actor, lease_version, reason, evidence, at)
    SELECT m.id, m.from_state, m.to_state, :actor, m.lease_version, m.note,
           CAST(m.evidence AS json), clock_timestamp()
    FROM m
)

-- name: write_transitions.open_reviews
-- Part: the review items the rows ask for (at most one open item per operation: a partial
-- unique index).
, r AS (
    INSERT INTO review_items (operation_id, tenant, reason, evidence, version, created_at)
    SELECT m.id, m.tenant, m.review, CAST(m.review_evidence AS json), 1, clock_timestamp()
    FROM m
    WHERE m.review IS NOT NULL
    ON CONFLICT (operation_id) WHERE resolved_at IS NULL DO NOTHING
)

-- name: write_transitions.settle_reviews
-- Part: an operation leaving unknown takes its open review item with it (the operation row
-- first, then the item: the one lock order, as the item is found through the rows written).
, c AS (
    UPDATE review_items AS i
    SET resolved_at = clock_timestamp(), resolved_by = :actor,
        resolution = CAST(m.resolution AS json), version = i.version + 1
    FROM m
    WHERE m.resolution IS NOT NULL AND i.operation_id = m.id AND i.resolved_at IS NULL
)

-- name: write_transitions.start_attempts
-- Part: a send's attempt row, bounded by the claim's lease end.
, a AS (
    INSERT INTO attempts (operation_id, number, lease_version, worker, started_at, not_after)
    SELECT m.id, m.number, m.fence, :actor, clock_timestamp(), m.lease_until
    FROM m
    WHERE m.start
)

-- name: write_transitions.finish_attempts
-- Part: what came back for the attempt a transition ends.
, f AS (
    UPDATE attempts AS t
    SET finished_at = clock_timestamp(), proof = m.proof, status_code = m.status_code,
        detail = CAST(m.detail AS json)
    FROM m
    WHERE m.proof IS NOT NULL
      AND t.operation_id = m.id AND t.number = m.number AND t.lease_version = m.fence
)

-- name: write_transitions.end
SELECT id FROM m

-- name: serialize
-- A transaction-scoped advisory lock on a key (``Storage.serialize``): every other transaction
-- asking for the same key waits until this one commits or rolls back.
SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))

-- name: lock_order
-- An order's lock (``Storage.lock_order``), held until the transaction ends: one of
-- ``:stripes`` locks in the two-key space ``:space`` (never a ``serialize`` key), chosen by the
-- key's hash, so a transaction that writes on many orders holds a bounded number of locks.
SELECT pg_advisory_xact_lock(:space, CAST(hashtextextended(:key, 0) & (:stripes - 1) AS integer))

-- name: lock_order.shared
-- The same lock, shared: intakes on one order never wait for each other, only for an approval.
SELECT pg_advisory_xact_lock_shared(:space, CAST(hashtextextended(:key, 0) & (:stripes - 1) AS integer))
