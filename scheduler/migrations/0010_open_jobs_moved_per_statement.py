from django.db import migrations

from gpushare.db.migrations import postgresql_only

OPEN = "('queued', 'scheduled', 'running', 'preempted')"  # scheduler.models.OPEN_STATES

# A job whose state, class or submission time changes is moved in the table of unfinished jobs by one
# statement trigger per UPDATE of scheduler_job (migration 0006 had a row trigger): a statement that moves
# many jobs (an array cancelled, a pass placing 1,000 jobs, a bulk cancel) writes scheduler_openjob in two
# statements, so its count triggers (migration 0008) append one change per (tenant, class), not one per
# job. A 1,000-job cancel wrote 1,000 changes, each read by every admission of the tenant until the next
# pass folded them.
#
# What moved is the new rows that differ from the old in (state, class, submission time), found by EXCEPT
# (a hash or sort, never a join a cached plan could make quadratic). An UPDATE that moves nothing (a pass
# rewriting pending reasons, usage totals) reads its transition tables once and stops. Transition tables
# cannot go with a column list (UPDATE OF ...), so every UPDATE of scheduler_job keeps its old and new rows
# for the trigger; measured on 20,000 queued jobs (docs/benchmarks.md, session 23): 1,000 cancelled
# 60-86 -> 36-39 ms, 3,000 placed by the pass's UPDATE 240 -> 110 ms, 7,000 pending reasons and 500 usage
# totals the same within the noise, a one-job UPDATE ~+17 us. Deletions keep their row trigger: its WHEN
# skips the finished jobs a purge deletes.
TRIGGERS = f"""
DROP TRIGGER scheduler_job_open_changed ON scheduler_job;
DROP FUNCTION scheduler_open_job_changed();

CREATE FUNCTION scheduler_open_job_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT id, priority_id, submitted_at, state FROM after
                   EXCEPT ALL
                   SELECT id, priority_id, submitted_at, state FROM before) THEN
        RETURN NULL;
    END IF;
    INSERT INTO scheduler_openjob (job_id, tenant_id, priority_id, submitted_at, state)
        SELECT id, tenant_id, priority_id, submitted_at, state FROM (
            SELECT id, tenant_id, priority_id, submitted_at, state FROM after
            EXCEPT ALL
            SELECT id, tenant_id, priority_id, submitted_at, state FROM before
        ) AS moved WHERE state IN {OPEN}
        ON CONFLICT (job_id) DO UPDATE SET priority_id = EXCLUDED.priority_id,
            submitted_at = EXCLUDED.submitted_at, state = EXCLUDED.state;
    DELETE FROM scheduler_openjob WHERE job_id IN (
        SELECT id FROM after WHERE state NOT IN {OPEN}
        EXCEPT ALL
        SELECT id FROM before WHERE state NOT IN {OPEN});
    RETURN NULL;
END $$;
CREATE TRIGGER scheduler_job_open_moved AFTER UPDATE ON scheduler_job
    REFERENCING OLD TABLE AS before NEW TABLE AS after
    FOR EACH STATEMENT EXECUTE FUNCTION scheduler_open_job_moved();
"""

# Migration 0006's row trigger, as it was.
DROP_TRIGGERS = f"""
DROP TRIGGER scheduler_job_open_moved ON scheduler_job;
DROP FUNCTION scheduler_open_job_moved();

CREATE FUNCTION scheduler_open_job_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN {OPEN} THEN
        INSERT INTO scheduler_openjob (job_id, tenant_id, priority_id, submitted_at, state)
            VALUES (NEW.id, NEW.tenant_id, NEW.priority_id, NEW.submitted_at, NEW.state)
            ON CONFLICT (job_id) DO UPDATE SET priority_id = EXCLUDED.priority_id,
                submitted_at = EXCLUDED.submitted_at, state = EXCLUDED.state;
    ELSE
        DELETE FROM scheduler_openjob WHERE job_id = NEW.id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER scheduler_job_open_changed AFTER UPDATE OF state, priority_id, submitted_at ON scheduler_job
    FOR EACH ROW WHEN (
        (OLD.state IN {OPEN} OR NEW.state IN {OPEN})
        AND (OLD.state, OLD.priority_id, OLD.submitted_at) IS DISTINCT FROM (NEW.state, NEW.priority_id, NEW.submitted_at)
    ) EXECUTE FUNCTION scheduler_open_job_changed();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('scheduler', '0009_job_page_versions_kept_by_the_database'),
    ]

    operations = [
        postgresql_only(TRIGGERS, DROP_TRIGGERS),
    ]
