from django.db import migrations

from gpushare.db.migrations import postgresql_only

# The kept counts (migration 0008) read through two PL/pgSQL functions: the folded row plus the changes not
# folded yet. The scheduling pass VACUUMs the change table every few hundred folds (scheduler.counts), and a
# VACUUM updates the table's statistics in pg_class, which invalidates every cached plan that reads the
# table, on every connection: the admission read, a submit's insert with its queue position and the job
# list's positions were each planned again, whole (~1-1.5 ms after an idle second, against ~0.5 ms to run).
# Read inside a function, only the function's own small query is planned again. STABLE: each runs in the
# snapshot of the statement that calls it, so a count still sees a fold wholly or not at all.
FUNCTIONS = """
CREATE FUNCTION scheduler_tenant_open_counts(tenant bigint, OUT open bigint, OUT queued bigint)
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    SELECT coalesce(sum(k.open), 0), coalesce(sum(k.queued), 0) INTO open, queued
      FROM (SELECT c.open, c.queued FROM scheduler_openjobcount c WHERE c.tenant_id = tenant
            UNION ALL
            SELECT c.open, c.queued FROM scheduler_openjobcountchange c WHERE c.tenant_id = tenant) AS k;
END $$;

CREATE FUNCTION scheduler_queued_in(classes bigint[]) RETURNS bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT coalesce(sum(k.queued), 0)
              FROM (SELECT c.queued FROM scheduler_openjobcount c WHERE c.priority_id = ANY(classes)
                    UNION ALL
                    SELECT c.queued FROM scheduler_openjobcountchange c WHERE c.priority_id = ANY(classes)) AS k);
END $$;
"""

DROP_FUNCTIONS = """
DROP FUNCTION scheduler_tenant_open_counts(bigint);
DROP FUNCTION scheduler_queued_in(bigint[]);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0010_open_jobs_moved_per_statement"),
    ]

    operations = [
        postgresql_only(FUNCTIONS, DROP_FUNCTIONS),
    ]
