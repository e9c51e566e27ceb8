"""Every service that acts for a tenant runs in that tenant's scope (issue #18 point 4).

The services are found by introspection, not listed: every public function of every app's
``services`` module (or package) and ``*_services`` module that takes ``tenant`` or ``tenant_id``.
Each is called outside any scope with a tenant and must work; while it runs, every query on a
tenant-owned table (a model with django-scopes' ``ScopedManager``) must run inside that tenant's
scope. A service that forgot its scope raises ScopeError; one that turned scopes off to act for one
tenant (where a forgotten filter would read every tenant's rows) is caught by the query watch.
A new service is walked as soon as it exists: if the walk cannot build one of its arguments it
fails and names the argument to add to ``_arguments``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from types import ModuleType

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone
from django_scopes import ScopeError, get_scope, scopes_disabled

from accounts.models import Membership, Role
from accounts.selectors import limits_for
from accounts.services import token_create
from accounts.tenancy import acts_for_tenant, tenant_scope
from billing.models import Invoice
from billing.services.payments import customer_ensure
from endpoints.services import EndpointSpec, endpoint_create
from scheduler.admission import JobAsk
from scheduler.array_services import job_array_submit
from scheduler.arrays import array_parse
from scheduler.models import Job
from scheduler.services import JobSpec, priority_for
from tests.admission import broken_services
from tests.api.helpers import job_make
from tests.factories import member_add
from webhooks.models import Delivery
from webhooks.services import event_emit, webhook_create

pytestmark = pytest.mark.django_db

ROOT = Path(settings.BASE_DIR).resolve()
TENANT_ARGS = ("tenant", "tenant_id")
# The first table a statement reads or writes (joins ride on it, as django-scopes filters them).
TABLE = re.compile(r'^\s*(?:SELECT\b.*?\bFROM|INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+"(\w+)"', re.I | re.S)


def app_modules(kind: str) -> list[ModuleType]:
    """Each project app's (and its ``api`` package's) ``<kind>`` module, every module of a ``<kind>``
    package, and ``*_<kind>`` modules: ``services`` or ``selectors``."""
    found = []
    for config in apps.get_app_configs():
        path = Path(config.path).resolve()
        if ROOT not in path.parents:
            continue
        for package, where in ((config.name, path), (f"{config.name}.api", path / "api")):
            for info in pkgutil.iter_modules([str(where)]):
                if info.name == kind or info.name.endswith(f"_{kind}"):
                    module = importlib.import_module(f"{package}.{info.name}")
                    found.append(module)
                    if info.ispkg:
                        found += [
                            importlib.import_module(f"{module.__name__}.{sub.name}")
                            for sub in pkgutil.iter_modules(module.__path__)
                        ]
    return found


def tenant_services(module: ModuleType) -> dict[str, object]:
    return {
        f"{module.__name__}.{name}": func
        for name, func in inspect.getmembers(module, inspect.isfunction)
        if func.__module__ == module.__name__
        and not name.startswith("_")
        and any(arg in inspect.signature(func).parameters for arg in TENANT_ARGS)
    }


def scoped_tables() -> set[str]:
    return {
        model._meta.db_table
        for model in apps.get_models()
        if hasattr(type(model._default_manager), "with_scopes_disabled")  # django-scopes' ScopedManager
    }


@contextlib.contextmanager
def query_watch(tenant_id: int):
    """Record every statement on a tenant table that runs outside ``tenant_id``'s scope."""
    tables, strays = scoped_tables(), []

    def watch(execute, sql, params, many, context):
        match = TABLE.match(sql)
        if match and match.group(1) in tables:
            current = get_scope()
            value = current.get("tenant")
            if not current.get("_enabled", True) or getattr(value, "pk", value) != tenant_id:
                where = "scopes disabled" if not current.get("_enabled", True) else f"scope {current}"
                strays.append(f"{match.group(1)} ({where})")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watch):
        yield strays


def call_watched(func, kwargs: dict, tenant_id: int | None = None) -> str | None:
    """Call ``func`` in a savepoint rolled back after (a returned queryset is read); what went wrong, or None."""
    if tenant_id is None:
        tenant_id = kwargs["tenant"].pk if "tenant" in kwargs else kwargs["tenant_id"]
    try:
        with transaction.atomic(), query_watch(tenant_id) as strays:
            result = func(**kwargs)
            if isinstance(result, QuerySet):
                list(result)
            transaction.set_rollback(True)
    except ScopeError as exc:
        return f"ScopeError: {exc}"
    except Exception as exc:  # noqa: BLE001 (the walk reports what each function raised)
        return f"raised {type(exc).__name__}: {exc}"
    if strays:
        return "queries outside the tenant's scope: " + ", ".join(sorted(set(strays)))
    return None


def walk(modules, arguments) -> tuple[list[str], dict[str, str]]:
    """Call each service that takes a tenant outside any scope: it must work, in its tenant's scope.
    Returns (the services walked, problems by service)."""
    walked, problems = [], {}
    for module in modules:
        for name, func in sorted(tenant_services(module).items()):
            walked.append(name)
            assert get_scope() == {}, "the walk calls services outside any scope"
            if (problem := call_watched(func, arguments(func))) is not None:
                problems[name] = problem
    return walked, problems


def tenant_models() -> dict[str, type]:
    """Tenant-owned models by class name (how a service's annotation names them)."""
    return {m.__name__: m for m in apps.get_models() if any(f.name == "tenant" for f in m._meta.fields)}


def row_services(module: ModuleType) -> dict[str, object]:
    """Public functions that take a tenant-owned row as a keyword-only argument (``job: Job``...);
    positional ones are helpers that run inside their caller's scope."""
    models, found = tenant_models(), {}
    for name, func in inspect.getmembers(module, inspect.isfunction):
        if func.__module__ != module.__name__ or name.startswith("_"):
            continue
        annotations = inspect.unwrap(func).__annotations__
        for param in inspect.signature(func).parameters.values():
            annotation = annotations.get(param.name)
            annotation = annotation.split("|")[0].strip() if isinstance(annotation, str) else None
            if param.kind == param.KEYWORD_ONLY and annotation in models:
                found[f"{module.__name__}.{name}"] = func
    return found


def row_walk(modules, arguments, tenant) -> tuple[list[str], dict[str, str]]:
    """Each service that takes one of the tenant's rows, called outside any scope: it raises ScopeError
    (it needs its caller's scope) or works in the row's tenant's scope, never with scopes turned off."""
    walked, problems = [], {}
    for module in modules:
        for name, func in sorted(row_services(module).items()):
            walked.append(name)
            problem = call_watched(func, arguments(func), tenant_id=tenant.pk)
            if problem is not None and not problem.startswith("ScopeError"):
                problems[name] = problem
    return walked, problems


def selector_walk(modules, arguments) -> tuple[list[str], dict[str, str]]:
    """Each selector that takes a tenant: outside any scope it raises ScopeError (it reads through the
    caller's scope) or enters its tenant's scope itself; in its tenant's scope it works, reading only there."""
    walked, problems = [], {}
    for module in modules:
        for name, func in sorted(tenant_services(module).items()):
            walked.append(name)
            kwargs = arguments(func)
            outside = call_watched(func, kwargs)
            if outside is not None and not outside.startswith("ScopeError"):
                problems[name] = f"outside a scope: {outside}"
            with tenant_scope(kwargs["tenant"]):
                if (inside := call_watched(func, kwargs)) is not None:
                    problems[name] = f"in its tenant's scope: {inside}"
    return walked, problems


@pytest.fixture
def arguments(rules, tenant, other_tenant):
    """Builds a service's or selector's arguments by name (the walk fails naming any it cannot build)."""
    owner = member_add(tenant, role=Role.OWNER)
    theirs = job_make(other_tenant)  # another tenant's rows, which nothing of `tenant` may read
    mine = job_make(tenant)
    with scopes_disabled():
        invoice = Invoice.objects.create(
            tenant=tenant, month=date.today().replace(day=1) - timedelta(days=40), state=Invoice.State.OPEN
        )
    priority = priority_for(kind="training")
    now = timezone.now()
    member = member_add(tenant, role=Role.MEMBER)
    webhook = webhook_create(tenant=tenant, user=owner, url="https://93.184.215.14/hook", event_types=["job.*"])
    event = event_emit(tenant_id=tenant.pk, type="job.queued", data={"job": mine.pk})
    job_array = job_array_submit(
        tenant=tenant,
        user=owner,
        spec=JobSpec(kind="training", gpu_milli=1000, command=["true"], name="walk"),
        array=array_parse({"count": 2}),
    )
    rows = {  # one row of `tenant` per tenant-owned model a service takes
        "job": mine,
        "endpoint": endpoint_create(
            tenant=tenant, user=owner, spec=EndpointSpec(name="walked", command=["serve"], gpu_milli=500)
        ),
        "webhook": webhook,
        "invoice": invoice,
        "token": token_create(tenant=tenant, user=member, name="walk").token,
    }
    with scopes_disabled():
        rows["delivery"] = Delivery.objects.get(event=event)
        rows["membership"] = Membership.objects.get(tenant=tenant, user=member)
    known = {
        "tenant": tenant,
        "tenant_id": tenant.pk,
        "user": owner,
        "actor": owner,
        "reason": "the walk",
        "action": "walk.test",
        "month": date.today().replace(day=1),
        "email": "invited@example.com",
        "name": "walk",
        "changes": {"name": "Walked"},
        "url": "https://93.184.215.14/hook",  # public: the SSRF check passes without DNS
        "event_types": ["job.*"],
        "type": "job.queued",
        "data": {"job": 1},
        "mode": "dedicated",
        "priority": priority,
        "ask": JobAsk(kind="training", mode="dedicated", gpu_milli=1000, max_runtime_s=60, price_multiplier=Decimal(1)),
        "array": array_parse({"count": 3}),
        "idempotency_key": "walk-key",
        "gpu_milli": 500,
        "gpu_model": "",
        "endpoint_id": None,
        "max_replicas": 1,
        "payment_method_id": "pm_card_visa",
        # selectors
        "viewer": owner,
        "job_id": mine.pk,
        "job_ids": [mine.pk, theirs.pk],
        "rows": [{"id": mine.pk, "state": "queued"}],  # a page's plain rows (scheduler.api.selectors.job_api_rows)
        "offset": 0,
        "direction": "n",  # a keyset page (scheduler.api.page_selectors.job_page_json): newest first
        "key": None,
        "size": 10,
        "invoice_id": invoice.pk,
        "at": now,
        "start": now - timedelta(days=30),
        "end": now,
        "group_by": "day",
        "held": [],
        "see_all": True,
        "limits": limits_for(tenant),
        "multiplier": Decimal(1),
        "max_runtime_s": 3600,
        "role": Role.VIEWER,
        **rows,
    }
    by_function = {
        "endpoint_admit": {"priority": "serving"},
        "job_array_cancel": {"array": job_array},
        "array_tasks_make": {"array": job_array},
    }
    # Each call gets the tenant's rows afresh: a service may change its row in memory (a delete clears the pk).
    owned = tuple(tenant_models().values())
    stored = {key: (type(value), value.pk) for key, value in known.items() if isinstance(value, owned)} | {
        f"{function}.{key}": (type(value), value.pk)
        for function, values in by_function.items()
        for key, value in values.items()
        if isinstance(value, owned)
    }

    def value(function: str, name: str):
        found = by_function.get(function, {})
        key = f"{function}.{name}" if name in found else name
        if key in stored:
            model, pk = stored[key]
            return model._base_manager.get(pk=pk)
        return found[name] if name in found else known[name]

    specs = {
        "scheduler": JobSpec(kind="training", gpu_milli=1000, command=["true"], name="walk"),
        "endpoints": EndpointSpec(name="walk", command=["serve"], gpu_milli=500),
    }

    def build(func):
        kwargs = {}
        for name, param in inspect.signature(func).parameters.items():
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            if name == "spec":
                kwargs[name] = specs[func.__module__.split(".")[0]]
            elif name in by_function.get(func.__name__, {}) or name in known:
                kwargs[name] = value(func.__name__, name)
            elif param.default is inspect.Parameter.empty:
                pytest.fail(f"the service walk cannot build {func.__module__}.{func.__name__}'s {name!r}: add it")
        return kwargs

    return build


def test_every_service_that_takes_a_tenant_runs_in_its_scope(arguments, localstripe, tenant):
    # The Stripe customer exists before the walk: localstripe keeps what a rolled-back call created there.
    customer_ensure(tenant=tenant)
    walked, problems = walk(app_modules("services"), arguments)
    assert problems == {}, "\n".join(f"{name}: {problem}" for name, problem in problems.items())
    assert {  # the walk found the services by itself, in every app that has them
        "scheduler.services.job_submit",
        "scheduler.array_services.job_array_submit",
        "endpoints.services.endpoint_create",
        "webhooks.services.webhook_create",
        "webhooks.services.event_emit",
        "accounts.services.tokens.token_create",
        "billing.services.invoices.invoice_close",
        "admission.services.job_admit",
    } <= set(walked)


def test_every_service_that_takes_a_tenants_row_runs_in_its_scope_or_raises(arguments, tenant):
    walked, problems = row_walk(app_modules("services"), arguments, tenant)
    assert problems == {}, "\n".join(f"{name}: {problem}" for name, problem in problems.items())
    assert {
        "scheduler.services.job_cancel",
        "scheduler.array_services.job_array_cancel",
        "endpoints.services.endpoint_update",
        "webhooks.services.webhook_update",
        "webhooks.services.delivery_resend",
        "billing.services.invoices.invoice_void",
        "accounts.services.members.member_role_change",
        "accounts.services.tokens.token_revoke",
        "console.services.job_priority_change",
    } <= set(walked)


def test_every_selector_that_takes_a_tenant_reads_only_in_its_scope(arguments):
    walked, problems = selector_walk(app_modules("selectors"), arguments)
    assert problems == {}, "\n".join(f"{name}: {problem}" for name, problem in problems.items())
    assert {
        "scheduler.selectors.jobs_for_tenant",
        "scheduler.api.selectors.queue_positions",
        "scheduler.api.selectors.queue_positions_page",
        "scheduler.api.page_selectors.job_page_json",
        "scheduler.api.page_selectors.job_page_versions",
        "scheduler.api.page_selectors.job_page_rows",
        "scheduler.api.selectors.gpu_uuids_of",
        "scheduler.api.selectors.job_api_rows_complete",
        "webhooks.selectors.webhooks_for_tenant",
        "portal.selectors.live_jobs",
        "billing.selectors.invoices_for_tenant",
        "admission.selectors.holds_open",
        "accounts.selectors.members_for",
    } <= set(walked)


def test_the_walk_catches_a_service_that_forgot_its_scope_or_turned_scopes_off(arguments, tenant):
    walked, problems = walk([broken_services], arguments)
    assert sorted(walked) == [
        "tests.admission.broken_services.jobs_count",
        "tests.admission.broken_services.jobs_count_forgot_scope",
        "tests.admission.broken_services.jobs_count_scopes_disabled",
    ]
    assert problems["tests.admission.broken_services.jobs_count_forgot_scope"].startswith("ScopeError")
    assert problems["tests.admission.broken_services.jobs_count_scopes_disabled"] == (
        "queries outside the tenant's scope: scheduler_job (scopes disabled)"
    )
    assert "tests.admission.broken_services.jobs_count" not in problems
    with scopes_disabled():
        mine = Job.objects.filter(tenant=tenant).count()
    assert broken_services.jobs_count(tenant=tenant) == mine  # its scope, not the other tenant's job


def test_a_tenant_scope_never_means_every_tenant(rules, tenant, other_tenant):
    with pytest.raises(ValueError):
        tenant_scope(None)
    with pytest.raises(TypeError):
        acts_for_tenant("job")(lambda *, tenant: None)
    with tenant_scope(tenant):
        assert get_scope()["tenant"] == tenant.pk

    @acts_for_tenant(("scheduler.Job", "job_id"))
    def jobs_seen(*, job_id):
        return sorted(Job.objects.values_list("pk", flat=True))

    mine, theirs = job_make(tenant), job_make(other_tenant)
    assert jobs_seen(job_id=mine.pk) == [mine.pk]  # a row's id: its tenant's scope
    assert jobs_seen(job_id=theirs.pk) == [theirs.pk]
    assert jobs_seen(job_id=10**9) == []  # a row that is gone: an empty scope, not every tenant
