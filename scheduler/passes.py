"""The scheduling pass: read the queue and the fleet in bulk, let the pure core
decide (:func:`scheduler.placement.plan`), write every decision in one
transaction under the scheduler lock, and dispatch launches and stops after
commit. The number of queries does not grow with the queue.

Passes are asked for on submit/finish events (:func:`pass_request`) and run
every few seconds by beat. A trigger that arrives while a pass is already
queued is folded into it; the flag is cleared when the queued pass starts,
before it reads anything, so a trigger is never lost. Passes are also paced:
a trigger that arrives while a pass runs, or soon after, asks for the next one
at the pace (:func:`pace_ms`: four times the last pass's duration after its
start, at most 1 s), so a stream of triggers (a
burst of submits, exits streaming in) gets passes that take at most a quarter
of a worker's time, instead of passes back to back taking a core from the
requests that trigger them. A trigger on a quiet cluster starts a pass at once
(its last pass took a few ms, so the pace is over before anyone could notice).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache

import redis
from django.conf import settings
from django.db import connection, transaction
from django.db.models import IntegerField
from django.db.models.expressions import RawSQL
from django.utils import timezone
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from gpushare.ratelimit import script_run
from webhooks import emit as webhook_emit

from . import placement
from .counts import counts_fold
from .locks import pass_lock_acquire
from .models import (
    ACTIVE_STATES,
    MILLI_PER_GPU,
    TRANSITIONS,
    Allocation,
    Job,
    JobEvent,
    JobMode,
    JobState,
    PriorityClass,
    SchedulerSettings,
    TenantShare,
    TenantUsage,
)
from .moves import claims_open, defrag_step

log = logging.getLogger(__name__)

PASS_FLAG_KEY = "gpushare:scheduler:pass-queued"
PASS_FLAG_TTL_S = 30  # if a queued pass is lost, beat's next pass covers it anyway
PASS_PACE_KEY = "gpushare:scheduler:pass-pace"  # set while a pass runs: when the next may start
# Set after a pass that changed nothing while jobs waited (no room for any of them): new jobs alone (submits)
# then wait this long for the next pass; a change that may make room (a job ends, a node comes up, a cancel)
# asks without waiting and clears it. Each pass in a row that changes nothing doubles the hold, up to
# NO_PROGRESS_MAX_MS (NO_PROGRESS_HOLD_KEY: its length now): a sweep submitted into a full cluster gets a
# pass or two a second that find no room, not four (each reads the whole queue).
NO_PROGRESS_KEY = "gpushare:scheduler:no-progress"
NO_PROGRESS_HOLD_KEY = "gpushare:scheduler:no-progress-hold"
NO_PROGRESS_PACE_MS = 250
NO_PROGRESS_MAX_MS = 1000
NO_PROGRESS_HOLD_TTL_S = 60  # a streak this old is over: the next hold starts again at NO_PROGRESS_PACE_MS
PASS_LAST_MS_KEY = "gpushare:scheduler:pass-last-ms"  # how long the last pass took
PACE_DUTY = 4  # a pass may start this many times its duration after the previous one started
PACE_MAX_MS = 1000
LOCKED_ROWS_RETRY_MS = 250  # a pass that found queued rows held by another transaction looks again after this
ESTIMATE_SLACK = timedelta(seconds=30)  # estimated starts move less than this are not rewritten


# -- triggers ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _redis():
    url = getattr(settings, "REDIS_URL", "")
    if not url.startswith(("redis://", "rediss://")):
        return None
    return redis.Redis.from_url(url, socket_timeout=2)


def pace_ms(last_ms: int) -> int:
    """How long after a pass starts the next may start, given the last pass's duration: ``PACE_DUTY``
    times it (so while triggers stream in, passes take at most a quarter of a worker's time, however
    short each is), at most ``PACE_MAX_MS``. An idle cluster's passes take a few ms: no wait to see."""
    return min(max(0, last_ms) * PACE_DUTY, PACE_MAX_MS)


# A trigger's whole look at Redis, one round trip. When no pass is queued, it queues one (sets the flag)
# and answers how long the pass must wait: the pace's time left, for a submit the no-progress hold's, at
# least ARGV[3] ms; the flag holds when that pass may start (ms since the epoch, Redis's clock). When one is
# queued already, it answers how long until that one may start. A trigger that is not a submit clears the
# no-progress hold and its streak. KEYS: flag, pace, no-progress, no-progress hold; ARGV: the flag's TTL (s),
# "1" for a submit, the least wait (ms). Answers {1 if this trigger queued the pass, its wait (ms), ms until
# the queued pass may start}.
TRIGGER = """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
local held = -2
if ARGV[2] == '1' then held = redis.call('PTTL', KEYS[3]) else redis.call('DEL', KEYS[3], KEYS[4]) end
local wait = math.max(redis.call('PTTL', KEYS[2]), held, tonumber(ARGV[3]), 0)
if redis.call('SET', KEYS[1], now + wait, 'NX', 'EX', ARGV[1]) then return {1, wait, wait} end
local starts = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
return {0, 0, math.max(starts - now, 0)}
"""

# A pass that changed nothing: the hold twice the last one in this streak (the first: ARGV[1]), at most
# ARGV[2] ms; KEYS: no-progress, no-progress hold; ARGV[3]: the streak's TTL (s). Answers the hold (ms).
NO_PROGRESS_HOLD = """
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local hold = math.min(math.max(tonumber(ARGV[1]), last * 2), tonumber(ARGV[2]))
redis.call('SET', KEYS[1], '1', 'PX', hold)
redis.call('SET', KEYS[2], hold, 'EX', ARGV[3])
return hold
"""


@lru_cache(maxsize=1)
def _trigger_script(client):
    return client.register_script(TRIGGER)


@lru_cache(maxsize=1)
def _hold_script(client):
    return client.register_script(NO_PROGRESS_HOLD)


# This process's knowledge that a queued pass will not start before this time (time.monotonic()): a submit
# committed before then is read by that pass, and asks Redis nothing (``pass_request``). Learnt from the
# trigger script's answer, less COVER_MARGIN_MS: a pass is started by its worker at the countdown's end by
# that machine's clock (Celery's ETA), which may run ahead of this one's, and the answer took a round trip.
_covered_until = 0.0
COVER_MARGIN_MS = 100
COVER_MIN_MS = 200  # a queued pass sooner than this covers nothing here (a quiet cluster's passes start at once)


def pass_request(*, min_wait_ms: int = 0, submitted: bool = False) -> None:
    """Enqueue a pass unless one is queued and not started yet; delayed while the pace says wait
    (and at least ``min_wait_ms``). ``submitted``: asked for by new jobs only (a submit): after a pass
    that changed nothing while jobs waited, they wait the no-progress hold for the next (``NO_PROGRESS_PACE_MS``,
    doubled by each such pass in a row up to ``NO_PROGRESS_MAX_MS``), since new
    jobs rarely make a full cluster's queue move (Slurm's submits, likewise, look only at the top of its
    queue); anything else asks as before and lets the next submits' passes start at once again. One
    script call (:data:`TRIGGER`) on a pooled connection, except for a submit while this process knows a
    queued pass will start after it (``_covered_until``): that pass reads its job, and a burst of submits
    into a held queue asks Redis about once a hold, not once a submit."""
    from .tasks import schedule_pass_task

    global _covered_until
    if submitted and time.monotonic() < _covered_until:
        return
    client = _redis()
    wait_ms = min_wait_ms
    if client is not None:
        try:
            keys = [PASS_FLAG_KEY, PASS_PACE_KEY, NO_PROGRESS_KEY, NO_PROGRESS_HOLD_KEY]
            args = [PASS_FLAG_TTL_S, "1" if submitted else "0", min_wait_ms]
            queued, wait_ms, starts_in_ms = script_run(client, _trigger_script(client), keys, args)
            if submitted and starts_in_ms >= COVER_MIN_MS:
                _covered_until = time.monotonic() + (starts_in_ms - COVER_MARGIN_MS) / 1000
            if not queued:
                return
        except redis.RedisError:  # Redis down: enqueue anyway, the broker will say more
            log.warning("could not coalesce the scheduling pass trigger", exc_info=True)
    if wait_ms > 0:
        schedule_pass_task.apply_async(countdown=wait_ms / 1000)
    else:
        schedule_pass_task.delay()


def pass_started() -> None:
    """Called as a pass starts: triggers from now on enqueue the next one, paced after this one. After a
    pass that moved nothing, the hold on passes new jobs alone ask for starts again now (its length as the
    streak has it): a submit that arrives while this pass runs would otherwise read what is left of the
    last one's hold (counted from when it finished) and queue a pass right behind this one; this pass's own
    end sets the hold again, longer, or clears it if the queue moved."""
    client = _redis()
    if client is not None:
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.delete(PASS_FLAG_KEY).get(PASS_LAST_MS_KEY).get(NO_PROGRESS_HOLD_KEY)
                _, last_ms, hold_ms = pipe.execute()
            with client.pipeline(transaction=False) as pipe:
                if wait_ms := pace_ms(int(last_ms or 0)):
                    pipe.set(PASS_PACE_KEY, "1", px=wait_ms)
                pipe.set(NO_PROGRESS_KEY, "1", px=int(hold_ms or NO_PROGRESS_PACE_MS), xx=True)
                pipe.execute()
        except (redis.RedisError, ValueError):
            log.warning("could not clear the scheduling pass flag", exc_info=True)


def pass_finished(seconds: float, *, progressed: bool = True) -> None:
    """Remember how long the pass took (the pace of the next ones); a trigger from now on waits until
    ``pace_ms`` of this pass has passed since it started (none at all after a pass of a few ms). A pass
    that did not ``progress`` (jobs waited and it placed, preempted and moved nothing) holds the passes
    new jobs alone ask for (``pass_request(submitted=True)``): ``NO_PROGRESS_PACE_MS``, twice the last
    hold after such a pass in a row, at most ``NO_PROGRESS_MAX_MS`` (``NO_PROGRESS_HOLD``)."""
    client = _redis()
    if client is not None:
        ms = int(seconds * 1000)
        rest_ms = pace_ms(ms) - ms
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.set(PASS_LAST_MS_KEY, ms, ex=3600)
                if rest_ms > 0:
                    pipe.set(PASS_PACE_KEY, "1", px=rest_ms)
                else:
                    pipe.delete(PASS_PACE_KEY)
                if progressed:
                    pipe.delete(NO_PROGRESS_KEY, NO_PROGRESS_HOLD_KEY)
                else:
                    _hold_script(client)(
                        keys=[NO_PROGRESS_KEY, NO_PROGRESS_HOLD_KEY],
                        args=[NO_PROGRESS_PACE_MS, NO_PROGRESS_MAX_MS, NO_PROGRESS_HOLD_TTL_S],
                        client=pipe,
                    )
                pipe.execute()
        except redis.RedisError:
            log.warning("could not record the scheduling pass duration", exc_info=True)


# -- reading the state ---------------------------------------------------------------------------------------
def settings_get() -> SchedulerSettings:
    found = SchedulerSettings.objects.filter(pk=1).first()
    if found is None:
        found = SchedulerSettings(pk=1, default_max_runtime_s=settings.GPUSHARE["DEFAULT_MAX_RUNTIME_S"])
    return found


def _ms(value) -> int:
    return int(value.timestamp() * 1000)


def _fleet() -> tuple[list[placement.NodeSlot], dict[str, tuple[int, int, str]]]:
    """The nodes as the core sees them; and GPU uuid -> (gpu id, node id, isolation)."""
    nodes: dict[int, placement.NodeSlot] = {}
    gpus: dict[str, tuple[int, int, str]] = {}
    rows = Gpu.objects.order_by("node__name", "index").values_list(
        "id",
        "uuid",
        "model",
        "memory_mb",
        "reservation",
        "health",
        "isolation",
        "node_id",
        "node__name",
        "node__state",
        "mig_mode",
        "mig_instances",
    )
    for row in rows:
        gpu_id, uuid, model, memory, reservation, health, isolation, node_id, node_name, node_state = row[:10]
        node = nodes.get(node_id)
        if node is None:
            node = nodes[node_id] = placement.NodeSlot(name=node_name, schedulable=node_state == Node.State.UP)
        node.gpus.append(
            placement.GpuSlot(
                uuid=uuid,
                node=node_name,
                model=model,
                memory_mb=memory,
                reservation=reservation,
                healthy=health == Gpu.Health.OK,
                mig=mig_slots(*row[10:]),
            )
        )
        gpus[uuid] = (gpu_id, node_id, isolation)
    return list(nodes.values()), gpus


def mig_slots(mig_mode: bool, instances) -> tuple[tuple[int, str], ...] | None:
    """A GPU's MIG instances as the core takes them ((memory MiB, profile), smallest first); None when
    the GPU is not in MIG mode."""
    if not mig_mode:
        return None
    return tuple(sorted((int(i["memory_mb"]), str(i.get("profile", ""))) for i in instances or ()))


def _running(classes: dict[int, PriorityClass], conf: SchedulerSettings, now_ms: int) -> list[placement.Running]:
    held: dict[int, list[tuple[str, int]]] = {}
    for job_id, uuid, share in Allocation.objects.filter(released_at__isnull=True).values_list(
        "job_id", "gpu__uuid", "share_milli"
    ):
        held.setdefault(job_id, []).append((uuid, share))
    rows = Job.objects.filter(state__in=ACTIVE_STATES).values_list(
        "id",
        "tenant_id",
        "priority_id",
        "node__name",
        "started_at",
        "scheduled_at",
        "max_runtime_s",
        "gpu_memory_mb",
        "stop_requested",
        "mode",
    )
    running = []
    for job_id, tenant_id, priority_id, node, started, scheduled, max_runtime_s, memory, stop, mode in rows:
        gpus = held.get(job_id)
        if not gpus:
            continue
        klass = classes[priority_id]
        begun = started or scheduled
        start_ms = _ms(begun) if begun else now_ms
        running.append(
            placement.Running(
                job_id=job_id,
                tenant=str(tenant_id),
                rank=klass.rank,
                node=node or "",
                gpu_uuids=tuple(u for u, _ in gpus),
                share_milli=gpus[0][1],
                started_ms=_ms(started) if started else now_ms,
                end_ms=start_ms + (max_runtime_s or conf.default_max_runtime_s) * 1000,
                priority=klass.name,
                preemptible=klass.preemptible,
                min_runtime_ms=klass.min_runtime_s * 1000,
                gpu_memory_mb=(memory or 0) if mode == JobMode.SHARED else 0,
                stopping=bool(stop),
            )
        )
    return running


def _usage_update(running: list[placement.Running], tenant_ids: set[int], conf, now_ms: int) -> dict[str, float]:
    """Bring each tenant's decayed usage up to now, counting what it held since the last pass."""
    half_life_ms = max(1, conf.fair_share_half_life_s) * 1000
    held: dict[int, int] = {}
    for job in running:
        held[int(job.tenant)] = held.get(int(job.tenant), 0) + job.milli
    rows = {u.tenant_id: u for u in TenantUsage.objects.filter(tenant_id__in=tenant_ids | set(held))}
    changed, created = [], []
    for tenant_id in tenant_ids | set(held):
        row = rows.get(tenant_id)
        if row is None:
            rows[tenant_id] = row = TenantUsage(tenant_id=tenant_id, usage=0.0, as_of_ms=now_ms)
            created.append(row)
            continue
        elapsed = now_ms - row.as_of_ms
        if elapsed <= 0:
            continue
        row.usage = placement.usage_accumulate(
            row.usage, milli=held.get(tenant_id, 0), duration_ms=elapsed, half_life_ms=half_life_ms
        )
        row.as_of_ms = now_ms
        changed.append(row)
    TenantUsage.objects.bulk_create(created, ignore_conflicts=True)
    TenantUsage.objects.bulk_update(changed, ["usage", "as_of_ms"], batch_size=1000)
    return {str(t): row.usage for t, row in rows.items()}


def _tenant_limits() -> dict[str, placement.Limits]:
    """Per-tenant caps from the admission layer (its port raises if nothing provides it), as plain data."""
    from .admission import tenant_caps

    return {
        str(tenant_id): placement.Limits(
            dedicated_gpus=caps.max_dedicated_gpus,
            shared_milli=caps.max_shared_milli,
            blocked_reason=caps.blocked_reason,
        )
        for tenant_id, caps in tenant_caps().items()
    }


# -- the pass ------------------------------------------------------------------------------------------------
@dataclass
class PassResult:
    placed: int = 0
    pending: int = 0
    preempted: int = 0
    moved: int = 0  # slices moved to free GPUs for a waiting job (defragmentation)
    folded: int = 0  # open/queued count changes folded (scheduler.counts)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (read, plan, write)

    @property
    def progressed(self) -> bool:
        """Whether the queue moved (or nothing waited): not a pass that left every waiting job where it was."""
        return bool(self.placed or self.preempted or self.moved) or not self.pending


_QUEUED_COUNT_SQL = f"SELECT count(*) FROM {Job._meta.db_table} WHERE state = %s"

QUEUED_FIELDS = (
    "id",
    "tenant_id",
    "priority_id",
    "submitted_at",
    "mode",
    "gpu_milli",
    "gpu_model",
    "gpu_memory_mb",
    "max_runtime_s",
    "pending_reason",
    "estimated_start_at",
    "attempt",
)


@scopes_disabled()  # platform-wide: places every tenant's queue on the shared fleet
@transaction.atomic
def schedule_pass(*, now=None) -> PassResult:
    """Place what fits, preempt what must give way, record why the rest waits; dispatch after commit."""
    started = time.perf_counter()
    pass_lock_acquire()
    conf = settings_get()
    from .array_services import arrays_waiting_make  # it writes rows with this module's helpers

    arrays_waiting_make()  # arrays submitted since the last pass: their tasks join the queue in this one
    folded = counts_fold()  # the open/queued counts' changes since the last pass (scheduler.counts)
    # Queued rows are locked for the pass (a concurrent cancel waits, then sees the outcome);
    # rows another transaction holds now are left for the next pass. Every queued row is counted in the
    # same statement (one snapshot): a count of its own, a statement later, also counted the jobs
    # committed in between, and under a stream of submits asked for a retry after nearly every pass.
    fetched = list(
        Job.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(state=JobState.QUEUED)
        .annotate(queued_all=RawSQL(_QUEUED_COUNT_SQL, [JobState.QUEUED], output_field=IntegerField()))
        .values_list(*QUEUED_FIELDS, "queued_all")
    )
    queued = [row[:-1] for row in fetched]
    # The pass's clock is read after the queue: a job requeued (and its event written) while the pass
    # was starting is seen by this read, and its placement must not be stamped before its requeue.
    now = now or timezone.now()
    now_ms = _ms(now)
    queued_all = fetched[0][-1] if fetched else Job.objects.filter(state=JobState.QUEUED).count()
    if queued_all > len(queued):
        # Some queued rows were held by another transaction (a cancel, a late report of an older
        # attempt): nothing else may ask for a pass once it commits, so ask for the next one now.
        transaction.on_commit(lambda: pass_request(min_wait_ms=LOCKED_ROWS_RETRY_MS))
    classes = {c.pk: c for c in PriorityClass.objects.prefetch_related("may_preempt")}
    running = _running(classes, conf, now_ms)
    usage = _usage_update(running, {row[1] for row in queued}, conf, now_ms)
    if not queued:
        return PassResult(folded=folded, seconds=time.perf_counter() - started)
    nodes, gpu_ids = _fleet()
    claims = claims_open(now)
    policy = placement.Policy(
        now_ms=now_ms,
        weights={str(t): float(w) for t, w in TenantShare.objects.values_list("tenant_id", "weight")},
        usage=usage,
        half_life_ms=max(1, conf.fair_share_half_life_s) * 1000,
        limits=_tenant_limits(),
        may_preempt={c.name: frozenset(v.name for v in c.may_preempt.all()) for c in classes.values()},
        backfill=conf.backfill,
        default_max_runtime_ms=conf.default_max_runtime_s * 1000,
        preempt_grace_ms=max((c.grace_period_s for c in classes.values()), default=30) * 1000,
        claims=claims.gpus,
        **placement_inputs(now),
    )
    requests = [_request(row, classes) for row in queued]
    timings = {"read": time.perf_counter() - started}
    decided = placement.plan(nodes, requests, running=running, policy=policy)
    timings["plan"] = time.perf_counter() - started - timings["read"]
    rows = {row[0]: row for row in queued}
    _placements_write(decided.placements, rows, gpu_ids, now)
    preempted = _preemptions_write(decided.preemptions, classes)
    move = defrag_step(
        decided=decided,
        nodes=nodes,
        requests=requests,
        running=running,
        classes=classes,
        conf=conf,
        claims=claims,
        grace_ms=policy.preempt_grace_ms,
        now=now,
    )
    _pending_write(decided, rows, now)
    timings["write"] = time.perf_counter() - started - timings["read"] - timings["plan"]
    result = PassResult(
        placed=len(decided.placements),
        pending=len(decided.pending),
        preempted=preempted,
        moved=len(move.moves) if move else 0,
        folded=folded,
        seconds=time.perf_counter() - started,
        timings=timings,
    )
    transaction.on_commit(lambda: timings.setdefault("dispatch_started", time.perf_counter() - started))
    return result


def placement_inputs(now) -> dict:
    """What the placement score reads besides the queue (see :mod:`scheduler.placement.score`): model
    prices and the recent mix of request shapes (the console's what-if passes the same prices; its mix is its
    replayed queue)."""
    from .pricing import model_prices
    from .selectors import recent_shapes

    recent = tuple(
        placement.Request(
            job_id=0,
            tenant="",
            rank=0,
            submitted_ms=0,
            shared=mode == JobMode.SHARED,
            count=1 if mode == JobMode.SHARED else max(1, milli // MILLI_PER_GPU),
            share_milli=milli if mode == JobMode.SHARED else MILLI_PER_GPU,
            gpu_model=model,
            gpu_memory_mb=memory or 0,
        )
        for mode, milli, model, memory in recent_shapes()
    )
    return {"model_price": model_prices(at=now), "recent": recent}


def _request(row: tuple, classes: dict[int, PriorityClass]) -> placement.Request:
    job_id, tenant_id, priority_id, submitted_at, mode, milli, model, memory, max_runtime_s = row[:9]
    klass = classes[priority_id]
    shared = mode == JobMode.SHARED
    return placement.Request(
        job_id=job_id,
        tenant=str(tenant_id),
        rank=klass.rank,
        submitted_ms=_ms(submitted_at),
        shared=shared,
        count=1 if shared else milli // MILLI_PER_GPU,
        share_milli=milli if shared else MILLI_PER_GPU,
        gpu_model=model,
        gpu_memory_mb=memory or 0,
        max_runtime_ms=(max_runtime_s or 0) * 1000,
        priority=klass.name,
    )


def _placements_write(placements, rows: dict[int, tuple], gpu_ids: dict[str, tuple[int, int, str]], now) -> None:
    if not placements:
        return
    assert JobState.SCHEDULED in TRANSITIONS[JobState.QUEUED]
    allocations, jobs, events = [], [], []
    for decision in placements:
        row = rows[decision.job_id]
        gpus = [gpu_ids[uuid] for uuid in decision.gpu_uuids]
        for gpu_id, _, _ in gpus:
            allocations.append((row[1], decision.job_id, gpu_id, decision.share_milli, now))
        shared = row[4] == JobMode.SHARED
        jobs.append(
            Job(
                pk=decision.job_id,
                state=JobState.SCHEDULED,
                node_id=gpus[0][1],
                scheduled_at=now,
                pending_reason="",
                estimated_start_at=None,
                attempt=row[11] + 1,
                isolation=gpus[0][2] if shared else "exclusive",
            )
        )
        events.append(
            (
                row[1],
                decision.job_id,
                now,
                JobState.QUEUED,
                JobState.SCHEDULED,
                f"placed on {decision.node} ({', '.join(decision.gpu_uuids)})"[:300],
            )
        )
    jobs_update(
        jobs,
        {
            "state": "varchar",
            "node_id": "bigint",
            "scheduled_at": "timestamptz",
            "pending_reason": "varchar",
            "estimated_start_at": "timestamptz",
            "attempt": "integer",
            "isolation": "varchar",
        },
    )
    # After the jobs: an allocation written gives its job a new row version unless this transaction has
    # written the job already (a trigger, for kept job pages: migrations/0009), so this order writes each
    # placed job once.
    rows_insert(Allocation, ("tenant_id", "job_id", "gpu_id", "share_milli", "created_at"), allocations)
    rows_insert(JobEvent, ("tenant_id", "job_id", "at", "from_state", "to_state", "detail"), events)
    webhook_emit.jobs_scheduled(events)
    messages = launch_messages([d.job_id for d in placements])
    transaction.on_commit(lambda: nodes_send(messages))


def launch_messages(job_ids: list[int]) -> list[tuple[str, str, dict]]:
    """The ``agent.launch`` message of each placed job, from its active allocations."""
    uuids: dict[int, list[str]] = {}
    shares: dict[int, int] = {}
    for job_id, uuid, share in (
        Allocation.objects.filter(job_id__in=job_ids, released_at__isnull=True)
        .order_by("job_id", "gpu__index")
        .values_list("job_id", "gpu__uuid", "share_milli")
    ):
        uuids.setdefault(job_id, []).append(uuid)
        shares[job_id] = share
    rows = Job.objects.filter(pk__in=list(uuids)).values_list(
        "id",
        "attempt",
        "tenant__slug",
        "command",
        "env",
        "image",
        "mode",
        "max_runtime_s",
        "priority__grace_period_s",
        "node__name",
        "array_id",
        "array_index",
        "array__task_count",
    )
    default_grace = settings.GPUSHARE["STOP_GRACE_S"]
    return [
        (node, "agent.launch", {
            "job_id": job_id,
            "attempt": attempt,
            "tenant": slug,
            "command": command,
            "env": env,
            "image": image,
            "gpu_uuids": uuids[job_id],
            "share_milli": shares[job_id],
            "mode": mode,
            "max_runtime_s": max_runtime_s,
            "grace_s": grace or default_grace,
            **({"array": {"id": array_id, "index": index, "count": count}} if array_id else {}),
        })
        for job_id, attempt, slug, command, env, image, mode, max_runtime_s, grace, node, array_id, index, count in rows
    ]  # fmt: skip


def launches_resend(*, older_than_s: int = 30, now=None) -> int:
    """Send ``agent.launch`` again for jobs placed a while ago that never reported a start.

    Launches go out after the pass commits; a worker that dies in between
    leaves the job ``scheduled`` with no message on its way. The agent ignores
    a launch for an attempt it runs or already ran, so sending twice is safe.
    """
    cutoff = (now or timezone.now()) - timedelta(seconds=older_than_s)
    with scopes_disabled():  # platform-wide: every tenant's launches stuck on their way to a node
        stuck = list(
            Job.objects.filter(
                state=JobState.SCHEDULED, scheduled_at__lt=cutoff, node__state=Node.State.UP
            ).values_list("pk", flat=True)[:1000]
        )
        messages = launch_messages(stuck)
    if messages:
        log.warning("re-sending the launch of %d job(s) placed over %d s ago", len(messages), older_than_s)
        nodes_send(messages)
    return len(messages)


def rows_insert(model, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """Insert many rows in one statement per 2,000 (PostgreSQL); elsewhere bulk_create."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        model.objects.bulk_create([model(**dict(zip(columns, row, strict=True))) for row in rows], batch_size=500)
        return
    from psycopg2.extras import execute_values

    sql = f"INSERT INTO {model._meta.db_table} ({', '.join(columns)}) VALUES %s"
    with connection.cursor() as cursor:
        execute_values(cursor.cursor, sql, rows, page_size=2000)


def _preemptions_write(preemptions, classes: dict[int, PriorityClass]) -> int:
    if not preemptions:
        return 0
    by_victim = {p.victim_id: p for p in preemptions}
    requesters = dict(Job.objects.filter(pk__in=[p.for_job_id for p in preemptions]).values_list("id", "priority_id"))
    messages = []
    victims = (
        Job.objects.select_for_update(of=("self",))
        .filter(pk__in=list(by_victim), state__in=ACTIVE_STATES, stop_requested="")
        .select_related("node")
    )
    count = 0
    for job in victims:
        decision = by_victim[job.pk]
        by_class = classes[requesters[decision.for_job_id]].name
        reason = f"preempted for job {decision.for_job_id} ({by_class})"
        job.stop_requested = "preempt"
        job.stop_reason = reason
        job.save(update_fields=["stop_requested", "stop_reason"])
        JobEvent.objects.create(
            tenant_id=job.tenant_id, job=job, from_state=job.state, to_state=job.state, detail=reason
        )
        grace = classes[job.priority_id].grace_period_s
        messages.append(
            (
                job.node.name,
                "agent.stop",
                {"job_id": job.pk, "attempt": job.attempt, "reason": reason, "grace_s": grace},
            )
        )
        count += 1
    transaction.on_commit(lambda: nodes_send(messages))
    return count


def _pending_write(decided: placement.Plan, rows: dict[int, tuple], now) -> None:
    changed = []
    for job_id, reason in decided.pending.items():
        row = rows[job_id]
        at_ms = decided.estimated_start_ms.get(job_id)
        estimate = datetime.fromtimestamp(max(at_ms, _ms(now)) / 1000, tz=UTC) if at_ms else None
        old_reason, old_estimate = row[9], row[10]
        moved = (estimate is None) != (old_estimate is None) or (
            estimate is not None and abs(estimate - old_estimate) > ESTIMATE_SLACK
        )
        if reason[:200] != old_reason or moved:
            changed.append(Job(pk=job_id, pending_reason=reason[:200], estimated_start_at=estimate))
    jobs_update(changed, {"pending_reason": "varchar", "estimated_start_at": "timestamptz"})


def jobs_update(jobs: list[Job], fields: dict[str, str]) -> None:
    """Write ``fields`` of many jobs in one statement per 1,000 rows.

    PostgreSQL: ``UPDATE ... FROM (VALUES ...)`` (Django's bulk_update builds
    one CASE per field and row, 20x slower at 5,000 rows); elsewhere bulk_update.
    ``fields`` maps column -> PostgreSQL type for the VALUES casts.
    """
    if not jobs:
        return
    if connection.vendor != "postgresql":
        Job.objects.bulk_update(jobs, list(fields), batch_size=500)
        return
    from psycopg2.extras import execute_values

    columns = list(fields)
    assignments = ", ".join(f"{c} = v.{c}" for c in columns)
    template = "(%s::bigint, " + ", ".join(f"%s::{fields[c]}" for c in columns) + ")"
    sql = (
        f"UPDATE {Job._meta.db_table} AS j SET {assignments} "
        f"FROM (VALUES %s) AS v(id, {', '.join(columns)}) WHERE j.id = v.id"
    )
    rows = [(job.pk, *(getattr(job, c) for c in columns)) for job in jobs]
    with connection.cursor() as cursor:
        execute_values(cursor.cursor, sql, rows, template=template, page_size=1000)


def nodes_send(messages: list[tuple[str, str, dict]]) -> None:
    """Send (node, task, payload) commands: signed, through the platform's one sender (agents.dispatch)."""
    from agents.dispatch import nodes_send as send

    send(messages)
