"""Invalidate cached token checks (:mod:`accounts.principal_cache`) when what they depend on changes.

Connected in ``AccountsConfig.ready``. Not business logic: no row is written
here, only the tokens' version keys in Redis are bumped, so that a revoked
token, a removed member, a changed role, a deactivated user or a changed
tenant is refused or re-read on the very next request, whatever made the
change (a service, the admin, the shell).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models.signals import post_delete, post_save

from . import principal_cache
from .models import ApiToken, Membership, Tenant


def _token_changed(sender, instance: ApiToken, **kwargs) -> None:
    principal_cache.tokens_bump([instance.token_hash])


def _membership_changed(sender, instance: Membership, **kwargs) -> None:
    principal_cache.tokens_bump_where(user_id=instance.user_id, tenant_id=instance.tenant_id)


def _user_changed(sender, instance, created: bool = False, **kwargs) -> None:
    if not created:
        principal_cache.tokens_bump_where(user_id=instance.pk)


def _tenant_changed(sender, instance: Tenant, created: bool = False, **kwargs) -> None:
    if not created:
        principal_cache.tokens_bump_where(tenant_id=instance.pk)


def connect() -> None:
    if not principal_cache.enabled():
        return  # nothing is cached without Redis
    user_model = get_user_model()
    for signal in (post_save, post_delete):
        signal.connect(_token_changed, sender=ApiToken, dispatch_uid="auth-cache-token")
        signal.connect(_membership_changed, sender=Membership, dispatch_uid="auth-cache-membership")
        signal.connect(_user_changed, sender=user_model, dispatch_uid="auth-cache-user")
        signal.connect(_tenant_changed, sender=Tenant, dispatch_uid="auth-cache-tenant")
