"""Open and queued job counts per tenant and class that do not grow with the queue (PostgreSQL).

The database keeps them (migration 0008): every statement that changes the narrow table of unfinished
jobs (``OpenJob``) appends its net change per (tenant, class) to ``OpenJobCountChange``; each scheduling
pass folds the changes into ``OpenJobCount`` (:func:`counts_fold`). A count is the folded row plus the
changes not folded yet, read in one snapshot (through a STABLE function, migration 0011: the statement's
own), so it sees a fold either wholly or not at all. Writers only append: two submits of a tenant, or a
submit and a pass, never wait for each other on a counter.

What reads them: a tenant's open and queued counts at admission (``admission.selectors.job_counts``)
and a new job's queue position in the submit's own statement (``scheduler.services.job_insert``). Their
cost is the tenant's (or the classes') rows plus the changes since the last pass, not the queue.
"""

from __future__ import annotations

from django.db import connection

from .models import OpenJobCount, OpenJobCountChange, PriorityClass

COUNTS, CHANGES, CLASSES = (
    OpenJobCount._meta.db_table,
    OpenJobCountChange._meta.db_table,
    PriorityClass._meta.db_table,
)


def counts_fold() -> int:
    """Add every change visible now to the folded counts and delete it, in one statement (changes that
    commit meanwhile are left for the next fold); rows left at zero go. The number of changes folded. Run
    by the scheduling pass, under its lock."""
    if connection.vendor != "postgresql":
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            f"""WITH gone AS (DELETE FROM {CHANGES} RETURNING tenant_id, priority_id, open, queued),
                     net AS (SELECT tenant_id, priority_id, sum(open)::integer AS open,
                                    sum(queued)::integer AS queued
                               FROM gone GROUP BY tenant_id, priority_id),
                     kept AS (INSERT INTO {COUNTS} (tenant_id, priority_id, open, queued)
                                   SELECT tenant_id, priority_id, open, queued FROM net
                              ON CONFLICT (tenant_id, priority_id) DO UPDATE
                                  SET open = {COUNTS}.open + EXCLUDED.open,
                                      queued = {COUNTS}.queued + EXCLUDED.queued)
                SELECT count(*) FROM gone"""
        )
        (folded,) = cursor.fetchone()
        cursor.execute(f"DELETE FROM {COUNTS} WHERE open = 0 AND queued = 0")
    return folded


# The change table is a queue: every fold deletes what it read, and a count reads the table's whole
# width (the changes of a class, of every tenant). Its dead rows are read by every count until a VACUUM
# clears them; autovacuum looks at a table once a minute at best (never, where it is off), by which time
# a stream of submits has left tens of thousands (a submit's PostgreSQL time doubled at ~60,000). So the
# pass clears them itself once this many changes were folded since its last VACUUM of the table.
CHANGES_VACUUM_AFTER = 500
_folded_since_vacuum = [0]


def changes_vacuum(folded: int) -> bool:
    """Count ``folded`` changes (a pass's :func:`counts_fold`), and VACUUM the change table once
    ``CHANGES_VACUUM_AFTER`` have been folded by this process since its last one (after the pass's
    transaction: VACUUM runs outside one; a VACUUM of the table already running elsewhere is not waited
    for). Whether it ran. A few ms for a table of a few hundred dead rows."""
    _folded_since_vacuum[0] += folded
    due = _folded_since_vacuum[0] >= CHANGES_VACUUM_AFTER
    if not due or connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    _folded_since_vacuum[0] = 0
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM (SKIP_LOCKED) {CHANGES}")
    return True


# What reads a kept count calls one of these functions (migration 0011): the folded rows plus the changes not
# folded yet, summed, in the caller's snapshot. Not the tables themselves: the pass VACUUMs the change table
# (above), and a VACUUM invalidates every cached plan that reads a table on every connection, where a plan
# that only calls the function keeps (only the function's own small query is planned again).


def tenant_counts_sql(tenant: str) -> str:
    """A subquery of the tenant's ``open`` and ``queued`` jobs (``tenant``: the SQL of its id)."""
    return f"(SELECT n.open, n.queued FROM scheduler_tenant_open_counts({tenant}) AS n)"


def queued_in_sql(classes: str) -> str:
    """An expression: the queued jobs of every tenant in ``classes`` (the SQL of an array of class ids)."""
    return f"scheduler_queued_in({classes})"


def queued_ahead_sql(priority: str) -> str:
    """An expression: the queued jobs of every tenant in classes ranked above or equal to the class
    ``priority`` (the SQL of its id): the place a job submitted now takes in the queue, less one."""
    rank = f"(SELECT rank FROM {CLASSES} WHERE id = {priority})"
    return queued_in_sql(f"ARRAY(SELECT c.id FROM {CLASSES} c WHERE c.rank >= {rank})")
