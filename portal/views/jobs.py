"""Jobs: list (filter, search, sort, paginate, bulk cancel), submit, detail with live parts."""

from __future__ import annotations

import functools
import uuid
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from admission import selectors as admission_selectors
from endpoints.models import Endpoint
from scheduler import services
from scheduler.api.idempotency import Submitted, job_submit_idempotent
from scheduler.models import TERMINAL_STATES, Job, JobKind, JobState
from scheduler.selectors import job_log_read, jobs_for_tenant

from .. import selectors
from ..forms import JobSubmitForm, cli_for, curl_for, form_initial_from_job
from ..templatetags.portal import counted, money_exact, money_text
from ..tenancy import tenant_page
from .common import page

PAGE_SIZE = 25
LOG_CHUNK = 64 * 1024
MAX_BULK = 100
LOG_READS_AFTER_END = 3


def default_runtime_s() -> int:
    return settings.GPUSHARE["DEFAULT_MAX_RUNTIME_S"]


def _job(request, pk: int) -> Job:
    # The scope makes another tenant's job invisible: it answers 404 like a missing one.
    return get_object_or_404(jobs_for_tenant(tenant=request.portal.tenant), pk=pk)


# --- list ----------------------------------------------------------------------


@tenant_page
def job_list(request):
    f = {key: request.GET.get(key, "").strip() for key in ("state", "kind", "q", "sort")}
    jobs = selectors.jobs_search(tenant=request.portal.tenant, **{k: v for k, v in f.items()})
    array, array_states = _array_filter(request)
    if array is not None:
        f["array"] = str(array.pk)
        jobs = jobs.filter(array=array)
    paginator = Paginator(jobs, PAGE_SIZE)
    page_obj = paginator.get_page(request.GET.get("page"))
    query = urlencode({k: v for k, v in f.items() if v})
    unsorted = urlencode({k: v for k, v in f.items() if v and k != "sort"})
    return page(
        request,
        "portal/jobs_list.html",
        {
            "page_obj": page_obj,
            "jobs": list(page_obj.object_list),
            "filters": f,
            "query": query,
            "unsorted": f"{unsorted}&" if unsorted else "",
            "states": [("active", "Active (queued or running)"), *JobState.choices],
            "kinds": JobKind.choices,
            "sorts": [(key, key.title()) for key in selectors.SORTS],
            "terminal": sorted(TERMINAL_STATES),
            "array": array,
            "array_states": array_states,
        },
    )


def _array_filter(request):
    """``?array=ID``: the tenant's array (404 for another tenant's) and its task count per state."""
    raw = request.GET.get("array", "").strip()
    if not raw:
        return None, {}
    from scheduler.api.arrays import states_by_array
    from scheduler.array_services import array_tasks_make
    from scheduler.models import JobArray

    if not raw.isdigit() or len(raw) > 18:
        raise Http404
    array = get_object_or_404(JobArray.objects.filter(tenant=request.portal.tenant), pk=int(raw))
    array_tasks_make(array=array)  # moments after a submit the scheduler may not have made them yet
    return array, sorted(states_by_array(tenant=request.portal.tenant, array_ids=[array.pk])[array.pk].items())


@tenant_page(action="jobs.cancel")
@require_POST
def job_array_cancel(request, jobarray_id: int):
    """Cancel every unfinished task of an array (queued at once, running gracefully)."""
    from scheduler.array_services import job_array_cancel as cancel
    from scheduler.models import JobArray

    array = get_object_or_404(JobArray.objects.filter(tenant=request.portal.tenant), pk=jobarray_id)
    if not request.portal.may_act_on("jobs.cancel", owner_id=array.submitted_by_id):
        return page(request, "portal/forbidden.html", {"why": "Your role cancels only your own jobs."}, status=403)
    stopped = cancel(array=array, actor=request.user)
    messages.success(request, f"Cancelling {stopped} unfinished task{'s' if stopped != 1 else ''} of array {array.pk}.")
    return redirect(f"{reverse('portal:jobs')}?array={array.pk}")


@tenant_page(action="jobs.cancel")
@require_POST
def job_bulk_cancel(request):
    ids = [int(v) for v in request.POST.getlist("job") if v.isdigit()][:MAX_BULK]
    target = request.POST.get("next", "")
    target = target if target.startswith("/jobs/") or target == "/jobs" else reverse("portal:jobs")
    if not ids:
        messages.error(request, "Select at least one job to cancel.")
        return redirect(target)
    jobs = list(jobs_for_tenant(tenant=request.portal.tenant).filter(pk__in=ids))
    cancelled = 0
    refused = 0
    for job in jobs:
        if not request.portal.may_act_on("jobs.cancel", owner_id=job.submitted_by_id):
            refused += 1
        elif job.state not in TERMINAL_STATES:
            services.job_cancel(job=job, actor=request.user)
            cancelled += 1
    skipped = len(ids) - cancelled - refused
    text = f"Cancelling {counted(cancelled, 'job')}."
    if skipped:
        text += f" {skipped} already finished or not found, left as they are."
    if refused:
        text += f" {refused} submitted by someone else: your role cancels only your own jobs."
    messages.success(request, text)
    return redirect(target)


# --- submit -----------------------------------------------------------------------


def _submit_context(request, form: JobSubmitForm) -> dict:
    body = form.api_body or {}
    base_url = request.build_absolute_uri("/").rstrip("/")
    estimate = hold = None
    if form.mode is not None:
        runtime = body.get("max_runtime_seconds")
        runtime = runtime if isinstance(runtime, int) and runtime > 0 else default_runtime_s()
        estimate = selectors.submit_estimate(
            gpu_milli=form.gpu_milli,
            gpu_model=body.get("gpu_model", ""),
            priority=form.priority_class,
            max_runtime_s=runtime,
        )
        hold = admission_selectors.hold_preview(
            tenant=request.portal.tenant,
            mode=form.mode,
            gpu_milli=form.gpu_milli,
            gpu_model=body.get("gpu_model", ""),
            max_runtime_s=runtime,
            multiplier=form.priority_class.price_multiplier,
        )
    return {
        "form": form,
        "estimate": estimate,
        "hold": hold,
        "curl": curl_for(body, base_url=base_url),
        "cli": cli_for(body, base_url=base_url),
        "touched": request.POST.get("_touched", ""),
    }


def _submit_once(request, form: JobSubmitForm) -> Submitted:
    """Submit with the form's idempotency key: a resent form answers with the job it
    created. The same key with a changed request is a new job, so it gets a new key."""
    key = form.cleaned_data.get("idempotency_key") or ""
    submit = functools.partial(job_submit_idempotent, tenant=request.portal.tenant, user=request.user, spec=form.spec())
    try:
        return submit(idempotency_key=key)
    except services.JobError as exc:
        if exc.code != "conflict" or "Idempotency-Key" not in str(exc):
            raise
        return submit(idempotency_key=f"portal-{uuid.uuid4()}")


@tenant_page
def job_submit(request):
    can_submit = request.portal.can("jobs.submit")
    if request.method == "POST":
        if not can_submit:
            return page(request, "portal/forbidden.html", {"why": "Viewers cannot submit jobs."}, status=403)
        form = JobSubmitForm(request.POST)
        if form.is_valid():
            try:
                submitted = _submit_once(request, form)
            except services.JobError as exc:
                form.add_job_error(exc)
            else:
                if submitted.created:
                    messages.success(request, f"Job {submitted.job.pk} submitted.")
                return redirect("portal:job", pk=submitted.job.pk)
        return page(request, "portal/submit.html", _submit_context(request, form), status=400)
    initial = {}
    source = request.GET.get("from", "")
    if source.isdigit():
        initial = form_initial_from_job(_job(request, int(source)))
    if initial:
        form = preview = JobSubmitForm(data=initial)
    else:
        # A blank form, with the estimate and CI snippets of its defaults beside it.
        form = JobSubmitForm()
        preview = JobSubmitForm(data={name: f.initial or "" for name, f in form.fields.items()})
    preview.is_valid()
    context = {**_submit_context(request, preview), "form": form, "can_submit": can_submit}
    return page(request, "portal/submit.html", context)


@tenant_page
@require_POST
def job_submit_check(request):
    """Live validation while typing: field errors, estimate and curl, as out-of-band swaps."""
    form = JobSubmitForm(request.POST)
    form.is_valid()
    touched = {name for name in request.POST.get("_touched", "").split(",") if name}
    return page(
        request, "portal/partials/submit_check.html", {**_submit_context(request, form), "touched_fields": touched}
    )


# --- detail -------------------------------------------------------------------------


def _detail_context(request, job: Job) -> dict:
    allocations = selectors.job_allocations(job)
    return {
        "job": job,
        "events": selectors.job_events(job),
        "allocations": allocations,
        "queue_position": selectors.queue_ahead(job),
        "terminal": job.state in TERMINAL_STATES,
        "cancellable": job.state not in TERMINAL_STATES
        and not job.stop_requested
        and request.portal.may_act_on("jobs.cancel", owner_id=job.submitted_by_id),
    }


@tenant_page
def job_detail(request, pk: int):
    job = _job(request, pk)
    # A replica of an inference endpoint links back to it.
    endpoint = Endpoint.objects.filter(tenant=request.portal.tenant, replicas__job=job).only("pk", "name").first()
    return page(request, "portal/job_detail.html", {**_detail_context(request, job), "endpoint": endpoint})


@tenant_page
def job_live(request, pk: int):
    """State, timeline, why pending and placement: polled until the job ends."""
    job = _job(request, pk)
    return page(request, "portal/partials/job_live.html", _detail_context(request, job))


@tenant_page
def job_log(request, pk: int):
    """The log from ``offset``, appended to the page. It keeps polling while the
    job may still write, and for a few reads after it ends (the agent ships the
    tail of the output as the job exits)."""
    job = _job(request, pk)
    raw, idle_raw = request.GET.get("offset", "0"), request.GET.get("idle", "0")
    if not raw.isdigit() or len(raw) > 15 or not idle_raw.isdigit() or len(idle_raw) > 3:
        return HttpResponseBadRequest("offset must be a non-negative integer byte offset")
    data, next_offset = job_log_read(job, offset=int(raw), limit=LOG_CHUNK)
    ended = job.state in TERMINAL_STATES
    idle = 0 if data else int(idle_raw) + (1 if ended else 0)
    return page(
        request,
        "portal/partials/job_log.html",
        {
            "job": job,
            "text": data.decode("utf-8", errors="replace"),
            "next_offset": next_offset,
            "idle": idle,
            "follow": idle < LOG_READS_AFTER_END,
            "delay": "0s" if len(data) >= LOG_CHUNK else "2s",
        },
    )


@tenant_page
def job_metrics(request, pk: int):
    """Chart points (SM utilisation, GPU memory, power, cost) after ``after`` ms."""
    job = _job(request, pk)
    raw = request.GET.get("after", "0")
    if not raw.isdigit() or len(raw) > 15:
        return JsonResponse(
            {"error": {"code": "invalid", "message": "after must be a time in ms", "fields": {}}}, status=400
        )
    series = selectors.job_series(job, after_ms=int(raw))
    return JsonResponse(
        {
            **series.__dict__,
            "done": job.state in TERMINAL_STATES,
            "live": selectors.job_live_sample(job),
            "cost": str(job.cost),
            "cost_display": money_text(job.cost),
            "cost_exact": money_exact(job.cost),
        }
    )


@tenant_page(action="jobs.cancel")
@require_POST
def job_cancel(request, pk: int):
    job = _job(request, pk)
    if not request.portal.may_act_on("jobs.cancel", owner_id=job.submitted_by_id):
        return page(request, "portal/forbidden.html", {"why": "Your role cancels only your own jobs."}, status=403)
    if job.state in TERMINAL_STATES:
        messages.info(request, f"Job {job.pk} already ended ({job.state}).")
    else:
        services.job_cancel(job=job, actor=request.user)
        messages.success(request, f"Cancelling job {job.pk}.")
    if request.htmx:
        job = _job(request, pk)
        return page(request, "portal/partials/job_live.html", _detail_context(request, job))
    return redirect("portal:job", pk=job.pk)
