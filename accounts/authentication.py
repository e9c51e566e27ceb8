"""`Authorization: Bearer <token>` for the REST API."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

from django.utils import timezone
from django_scopes import scopes_disabled
from rest_framework import authentication, exceptions

from gpushare.observability.context import log_context_bind

from . import principal_cache
from .models import ApiToken, Membership
from .services import token_hash
from .tenancy import tenant_scope

LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenPrincipal:
    """What a request carries once a token is accepted: tenant, role, scopes."""

    def __init__(self, token: ApiToken, role: str):
        self.token = token
        self.tenant = token.tenant
        self.role = role
        self.scopes = frozenset(token.scopes)


class TokenRejected(Exception):
    """A bearer token that does not authenticate; the message says why."""


class Checked(NamedTuple):
    user: object
    principal: TokenPrincipal
    rate_waits: dict[str, int]  # the rate limits counted with the check (principal_cache.lookup)


def token_principal(plaintext: str, rates: Callable[[TokenPrincipal], list] | None = None) -> Checked:
    """The user and :class:`TokenPrincipal` of a valid token, else :class:`TokenRejected`.

    The one check every entry point uses (REST API, endpoint gateway): known,
    not revoked, not expired, active user still a member; records last use.
    A verified principal is reused from :mod:`accounts.principal_cache` while
    the token's version in Redis is unchanged (revocation, member removal or
    role change, user deactivation and tenant changes bump it; expiry is
    checked here on every request). ``rates``: the request's rate limits, counted in the same
    Redis round trip when the principal is cached (``principal_cache.lookup``).
    """
    digest = token_hash(plaintext)
    entry, version, rate_waits, seen = principal_cache.lookup(digest, rates)
    now = timezone.now()
    if entry is not None:
        token = entry.principal.token
        if token.expires_at is not None and token.expires_at <= now:
            principal_cache.forget(digest)
            raise TokenRejected("This API token has expired.")
        _last_used_record(token, now)
        return Checked(entry.user, entry.principal, rate_waits)
    user, principal = _token_check(digest, now)
    if version is not None:
        principal_cache.store(digest, user=user, principal=principal, version=version, seen=seen)
    return Checked(user, principal, rate_waits)


def _last_used_record(token: ApiToken, now) -> None:
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        with tenant_scope(token):
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now


def _token_check(digest: str, now) -> tuple:
    with scopes_disabled():  # the secret names the tenant: found before any tenant is known
        token = ApiToken.objects.select_related("tenant", "user").filter(token_hash=digest).first()
        if token is None:
            raise TokenRejected("Unknown API token.")
        if token.revoked_at is not None:
            raise TokenRejected("This API token has been revoked.")
        if token.expires_at is not None and token.expires_at <= now:
            raise TokenRejected("This API token has expired.")
        if not token.user.is_active:
            raise TokenRejected("The user this token belongs to is inactive.")
        role = Membership.objects.filter(tenant=token.tenant, user=token.user).values_list("role", flat=True).first()
        if role is None:
            raise TokenRejected("The token's user is no longer a member of its tenant.")
        _last_used_record(token, now)
    return token.user, TokenPrincipal(token, role)


def bearer_accept(request, plaintext: str, rates: Callable[[TokenPrincipal], list] | None) -> tuple:
    """``(user, principal)`` for an API call's bearer token (:func:`token_principal`), else
    :class:`TokenRejected`. The rate limits counted with it are left on the Django ``request`` for the
    throttles (``rate_waits``: no second round trip), and the request's log lines name the tenant.
    What the API's authentication class and its lean dispatch (gpushare/lean.py) both call."""
    user, principal, rate_waits = token_principal(plaintext, rates)
    if rate_waits:
        request.rate_waits = rate_waits
    log_context_bind(tenant=principal.tenant.slug)
    return user, principal


def bearer_parts(header: str) -> list[str] | None:
    """The words of an ``Authorization`` header whose scheme is Bearer (case-insensitive, RFC 9110), else
    None; a well-formed one has two. What the API's authentication class and its lean dispatch both read."""
    parts = header.split()
    if not parts or parts[0].lower() != "bearer":
        return None
    return parts


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <token>``. The API uses ``gpushare.throttling.BearerTokenAuthentication``,
    which adds the view's rate limits to the token check's round trip (:meth:`rates`)."""

    keyword = "Bearer"

    def rates(self, request) -> Callable[[TokenPrincipal], list] | None:
        """What to count with the token check (``token_principal``'s ``rates``); none here."""
        return None

    def authenticate(self, request):
        parts = bearer_parts(authentication.get_authorization_header(request).decode("latin-1"))
        if parts is None:
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header: expected 'Bearer <token>'.")
        try:
            return bearer_accept(request._request, parts[1], self.rates(request))
        except TokenRejected as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from exc

    def authenticate_header(self, request):
        return self.keyword
