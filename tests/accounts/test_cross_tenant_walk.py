"""Tenancy fails closed, proven by walking the URL resolver.

Every route under /api/v1/ and every page that takes an object id is found
from the resolver (so routes added later are covered without touching this
file), its ids are filled with ANOTHER tenant's objects, and it is called with
a token (API) or a session (pages) of each role of the first tenant. The
answer must be exactly what a missing id gets (404; or the same 403/405 when
the role or method is refused before any lookup), no response may carry the
other tenant's data, and the other tenant's objects must be unchanged.

The other tenant gets one object of every tenant-owned model: from BUILDERS
(through services, with realistic data) or, for a model added later, from its
required fields (generic_build). A route whose id cannot be mapped to a model, or
a model that cannot be built either way, fails the walk with a message saying
what to add.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta

import pytest
from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from django_scopes import ScopeError, scope, scopes_disabled
from rest_framework.test import APIClient

from accounts.models import Role, Tenant
from accounts.services import ALL_SCOPES, member_invite, token_create
from tests.factories import member_add

pytestmark = pytest.mark.django_db

MARKER = "SECRET-OF-TENANT-B"
ROLES = (Role.OWNER, Role.ADMIN, Role.MEMBER, Role.VIEWER)
MISSING_ID = 2_000_000_000
ID_KWARG = re.compile(r"^(pk|id|.+_id|.+_pk)$")
# Page areas that are not tenant pages: the operator's console and admin (staff only),
# the auth flows (their kwargs are secrets, not ids), the API (walked separately), docs.
NOT_TENANT_PAGES = ("admin/", "console/", "accounts/", "api/", "static/", "media/")
# Tenant-owned models that are deliberately reached only through platform services
# (no ScopedManager). Anything else with a tenant field must be scoped.
UNSCOPED_ON_PURPOSE = {
    "accounts.AuditLog": "platform-wide log; tenants read it only through accounts.selectors.audit_log_for",
    "scheduler.Allocation": "scheduler-internal bookkeeping of GPUs held; never served to tenants directly",
}


# --- the routes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    route: str  # the pattern as written, for test ids and messages
    name: str  # namespaced URL name, for reverse()
    kwargs: tuple[str, ...]  # id kwargs to fill
    methods: tuple[str, ...]
    callback: Callable
    api: bool

    def __str__(self) -> str:
        return self.route


def _patterns(patterns, prefix="", namespace=None):
    for p in patterns:
        if isinstance(p, URLResolver):
            ns = ":".join(filter(None, [namespace, p.namespace]))
            yield from _patterns(p.url_patterns, prefix + str(p.pattern), ns or None)
        elif isinstance(p, URLPattern):
            yield prefix + str(p.pattern), namespace, p


def _methods(callback, api: bool) -> tuple[str, ...]:
    actions = getattr(callback, "actions", None)
    if actions:
        return tuple(sorted(m.upper() for m in actions))
    cls = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if cls is not None:
        names = [m for m in cls.http_method_names if m not in ("options", "head", "trace") and hasattr(cls, m)]
        return tuple(sorted(m.upper() for m in names))
    return ("GET", "POST")  # a function view: try both (a 405 for one is fine if a missing id gets it too)


def routes(*, api: bool) -> list[Route]:
    found = []
    for route, namespace, pattern in _patterns(get_resolver().url_patterns):
        if "format" in pattern.pattern.regex.groupindex or not pattern.name:
            continue  # DRF's ".json" suffix twins of the routes below
        if api != route.startswith("api/v1/"):
            continue
        if not api and route.startswith(NOT_TENANT_PAGES):
            continue
        kwargs = tuple(k for k in pattern.pattern.regex.groupindex if k != "format")
        if not api and (not kwargs or not all(ID_KWARG.match(k) for k in kwargs)):
            continue  # pages without an object id (or keyed by a secret, like a reset link) show no object
        name = f"{namespace}:{pattern.name}" if namespace else pattern.name
        found.append(Route(route, name, kwargs, _methods(pattern.callback, api), pattern.callback, api))
    return found


API_ROUTES = routes(api=True)
PAGE_ROUTES = routes(api=False)


def test_the_walk_sees_the_routes():
    """Guard against a walker that silently finds nothing."""
    assert any(r.name == "job-detail" for r in API_ROUTES)
    assert any(r.route.endswith("cancel/$") and "POST" in r.methods for r in API_ROUTES)
    assert any("pk" in r.kwargs for r in PAGE_ROUTES)


# --- the other tenant's objects ------------------------------------------------------------


def tenant_models() -> dict[str, type[models.Model]]:
    out = {}
    for model in apps.get_models():
        field = next((f for f in model._meta.fields if f.name == "tenant"), None)
        if field is not None and field.related_model is Tenant:
            out[model._meta.label] = model
    return out


def _job(t, user):
    from scheduler.services import JobSpec, job_submit

    return job_submit(tenant=t, user=user, spec=JobSpec(kind="training", gpu_milli=1000, command=["echo", MARKER],
                                                        name=MARKER))  # fmt: skip


def _invoice(t, user):
    from billing.models import Invoice

    return Invoice.objects.create(tenant=t, month=date(2026, 1, 1), total="12.34", failure_message=MARKER)


def _usage_window(t, user, objs):
    from agents.models import Node
    from billing.models import UsageWindow

    node = Node.objects.get_or_create(name="walk-node", defaults={"state": "up", "token_hash": "0" * 64})[0]
    return UsageWindow.objects.create(
        tenant=t, job=objs["scheduler.Job"], node=node, seq=1, start_ms=1, end_ms=2, gpu_model=MARKER,
        mode="dedicated", gpu_ms=1, amount=0,
    )  # fmt: skip


def _endpoint(t, user):
    from endpoints.models import Endpoint

    return Endpoint.objects.create(
        tenant=t, created_by=user, name="walk-b", command=["serve", MARKER], image=MARKER, gpu_milli=250,
        min_replicas=0, max_replicas=1,
    )  # fmt: skip


BUILDERS: dict[str, Callable] = {
    "scheduler.Job": lambda t, u, objs: _job(t, u),
    "accounts.ApiToken": lambda t, u, objs: token_create(tenant=t, user=u, name=MARKER).token,
    "accounts.Membership": lambda t, u, objs: u.memberships.get(tenant=t),
    "accounts.Invitation": lambda t, u, objs: member_invite(tenant=t, actor=u, email="b-invitee@b.test").invitation,
    "billing.Invoice": lambda t, u, objs: _invoice(t, u),
    "billing.UsageWindow": _usage_window,
    "scheduler.JobEvent": lambda t, u, objs: objs["scheduler.Job"].events.first(),
    "endpoints.Endpoint": lambda t, u, objs: _endpoint(t, u),
}


def _value_for(field, t, user, objs):
    """A plausible value for a required field of a model the walk has no builder for."""
    if field.is_relation:
        target = field.related_model
        if target is Tenant:
            return t
        if target is type(user):
            return user
        built = objs.get(target._meta.label)
        if built is None:
            raise LookupError(f"needs a {target._meta.label}")
        return built
    if field.choices:
        return field.choices[0][0]
    if isinstance(field, models.BinaryField):
        return MARKER.encode()
    if isinstance(field, models.JSONField):
        return {"marker": MARKER}
    if isinstance(field, models.DateTimeField):
        return timezone.now()
    if isinstance(field, models.DateField):
        return date(2026, 1, 1)
    if isinstance(field, models.DecimalField | models.FloatField):
        return 0
    if isinstance(field, models.BooleanField):
        return False
    if isinstance(field, models.IntegerField | models.DurationField):
        return 1 if not isinstance(field, models.DurationField) else timedelta(seconds=1)
    if isinstance(field, models.CharField | models.TextField):
        return (
            MARKER.lower()[: field.max_length or None]
            if isinstance(field, models.SlugField)
            else (MARKER[: field.max_length or None])
        )
    raise LookupError(f"no value for {field.name} ({type(field).__name__})")


def generic_build(model, t, user, objs):
    """Create one row of ``model`` for tenant ``t`` from its required fields (None if impossible)."""
    values = {"tenant": t}
    try:
        for field in model._meta.concrete_fields:
            if field.name in values:
                continue
            if field.primary_key or field.has_default() or field.null or getattr(field, "auto_now", False):
                continue
            if getattr(field, "auto_now_add", False):
                continue
            values[field.name] = _value_for(field, t, user, objs)
        with transaction.atomic():
            return model._base_manager.create(**values)
    except (LookupError, ValueError, TypeError, IntegrityError, ValidationError):
        return None


@pytest.fixture
def world(rules, tenant, other_tenant):
    """Tenant B with one of each buildable tenant-owned object; returns (objects by model label, snapshot)."""
    owner_b = member_add(other_tenant, role=Role.OWNER)
    objs: dict[str, models.Model] = {}
    with scopes_disabled():
        for label, build in BUILDERS.items():
            try:
                apps.get_model(label)
            except LookupError:
                continue  # a model that does not exist (yet) in this tree
            objs[label] = build(other_tenant, owner_b, objs)
        for _ in range(2):  # twice: a model may need another one built first
            for label, model in tenant_models().items():
                if label not in objs and (built := generic_build(model, other_tenant, owner_b, objs)) is not None:
                    objs[label] = built
    return objs


def snapshot(objs) -> dict:
    volatile = {"last_used_at"}
    out = {}
    for label, obj in objs.items():
        row = type(obj)._base_manager.filter(pk=obj.pk).values().first()
        out[label] = {k: v for k, v in (row or {}).items() if k not in volatile}
    return out


def _drf_lookup(route: Route, kwarg: str) -> tuple[type[models.Model] | None, str]:
    """For a DRF view: the model and field its URL kwarg looks up (None when not a DRF lookup)."""
    cls = getattr(route.callback, "cls", None)
    if cls is None:
        return None, "pk"
    field = getattr(cls, "lookup_field", "pk")
    if kwarg not in ("pk", getattr(cls, "lookup_url_kwarg", None) or field):
        return None, "pk"
    model = getattr(getattr(cls, "queryset", None), "model", None)
    model = model or getattr(getattr(getattr(cls, "serializer_class", None), "Meta", None), "model", None)
    return model, field


def model_for(route: Route, kwarg: str) -> str:
    """Which model an id kwarg names: the DRF view's model, else the URL segment before it."""
    model, _ = _drf_lookup(route, kwarg)
    if model is not None:
        return model._meta.label
    if kwarg.endswith(("_id", "_pk")):
        noun = kwarg.rsplit("_", 1)[0]
    else:
        before = route.route.split(f"<int:{kwarg}>")[0].split(f"(?P<{kwarg}>")[0]
        segments = [s for s in re.split(r"[/^$]+", before) if s and "<" not in s and "(" not in s]
        noun = segments[-1] if segments else ""
    noun = noun.lower().removesuffix("s")
    names = {label: label.split(".")[1].lower() for label in tenant_models()}
    candidates = [label for label, name in names.items() if name in (noun, f"api{noun}")]
    candidates = candidates or [label for label, name in names.items() if noun and name.startswith(noun)]
    assert len(candidates) == 1, (
        f"cannot tell which tenant-owned model {kwarg!r} of {route.route!r} names ({noun!r} -> {candidates}); "
        "teach tests/accounts/test_cross_tenant_walk.py::model_for"
    )
    return candidates[0]


def _platform_only(route: Route) -> bool:
    """The route's objects are the platform's (e.g. nodes), not any tenant's: nothing to hide between tenants."""
    labels = {_drf_lookup(route, k)[0]._meta.label for k in route.kwargs if _drf_lookup(route, k)[0] is not None}
    return bool(route.kwargs) and len(labels) == len(route.kwargs) and not labels & set(tenant_models())


PLATFORM_ROUTES = [r for r in API_ROUTES if _platform_only(r)]
API_ROUTES = [r for r in API_ROUTES if not _platform_only(r)]


def test_platform_routes_serve_no_tenant_model():
    """Routes left out of the walk: each looks up a model without a tenant (listed for the reader)."""
    for route in PLATFORM_ROUTES:
        for kwarg in route.kwargs:
            model, _ = _drf_lookup(route, kwarg)
            assert not any(f.name == "tenant" for f in model._meta.fields), route.route


def url_for(route: Route, objs, *, missing: bool) -> str:
    kwargs = {}
    for kwarg in route.kwargs:
        label = model_for(route, kwarg)
        assert label in objs, (
            f"{route.route} takes a {label} id and none could be built from its fields: add a builder to BUILDERS"
        )
        field = _drf_lookup(route, kwarg)[1]
        value = getattr(objs[label], field)
        kwargs[kwarg] = (MISSING_ID if isinstance(value, int) else "no-such-object") if missing else value
    return reverse(route.name, kwargs=kwargs)


def call(client, method: str, url: str):
    return getattr(client, method.lower())(url, **({"data": {}, "format": "json"} if method != "GET" and
                                                  isinstance(client, APIClient) else {}))  # fmt: skip


def body(response) -> str:
    content = getattr(response, "content", None)
    if content is None:  # a streaming response
        content = b"".join(response.streaming_content)
    return content.decode("utf-8", "replace")


def check(route: Route, client, objs, *, role: str) -> None:
    before = snapshot(objs)
    for method in route.methods:
        if not route.kwargs:  # a list or a tenant-wide report
            if method != "GET":
                continue
            response = call(client, method, reverse(route.name))
            # 400: a report that needs query parameters; what matters is that nothing leaks
            assert response.status_code in (200, 400, 403), (route.route, role, response.status_code)
            assert MARKER not in body(response), f"{route.route} ({role}) shows another tenant's data"
            continue
        other = call(client, method, url_for(route, objs, missing=False))
        missing = call(client, method, url_for(route, objs, missing=True))
        where = f"{method} {route.route} as {role}: another tenant's id -> {other.status_code}, missing id -> " + str(
            missing.status_code
        )
        assert other.status_code == missing.status_code, where
        assert other.status_code in (403, 404, 405), where
        if method == "GET" and role == Role.OWNER and route.api:
            assert other.status_code == 404, where
        assert MARKER not in body(other), f"{where}: the body leaks the other tenant's data"
    assert snapshot(objs) == before, f"{route.route} as {role} changed another tenant's objects"


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("route", API_ROUTES, ids=str)
def test_api_route_hides_other_tenants(route, role, world, tenant):
    user = member_add(tenant, role=role)
    client = APIClient()
    plaintext = token_create(tenant=tenant, user=user, name="walk", scopes=ALL_SCOPES).plaintext
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    check(route, client, world, role=role)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("route", PAGE_ROUTES, ids=str)
def test_page_hides_other_tenants(route, role, world, tenant):
    client = Client()
    client.force_login(member_add(tenant, role=role))
    check(route, client, world, role=role)


# --- scopes fail closed ---------------------------------------------------------------------


@pytest.mark.parametrize("label", sorted(set(tenant_models()) - set(UNSCOPED_ON_PURPOSE)))
def test_unscoped_query_on_a_tenant_model_raises(label, tenant):
    model = tenant_models()[label]
    with pytest.raises(ScopeError):
        list(model.objects.all())
    with pytest.raises(ScopeError):
        model.objects.filter(pk=1).exists()
    with scope(tenant=tenant):
        list(model.objects.all())  # inside a scope it works
    with scopes_disabled():
        list(model.objects.all())


def test_scoped_query_sees_only_its_tenant(world, tenant, other_tenant):
    from scheduler.models import Job

    with scope(tenant=tenant):
        assert not Job.objects.filter(pk=world["scheduler.Job"].pk).exists()
        assert list(Job.objects.all()) == []
    with scope(tenant=other_tenant):
        assert Job.objects.get(pk=world["scheduler.Job"].pk).name == MARKER


def test_the_unscoped_list_is_current():
    assert set(UNSCOPED_ON_PURPOSE) <= set(tenant_models())


def test_the_world_holds_the_other_tenants_objects(world, tenant, other_tenant):
    """Sanity for the builders: every object is the other tenant's, and carries the marker where it can."""
    assert {"scheduler.Job", "accounts.ApiToken", "accounts.Membership"} <= set(world)
    assert all(obj.tenant_id == other_tenant.pk for obj in world.values())
    with scopes_disabled():
        job = type(world["scheduler.Job"]).objects.get(pk=world["scheduler.Job"].pk)
    assert job.name == MARKER and timezone.now() - job.submitted_at < timedelta(minutes=5)
