from django.core.management.base import BaseCommand, CommandError

from accounts.models import Tenant
from accounts.services import AccountsError, tenant_reinstate, tenant_suspend


class Command(BaseCommand):
    help = "Suspend a tenant (no new jobs; running jobs stop or finish per its on_suspended setting), or reinstate it."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--reason", default="", help="why (required to suspend; recorded in the audit log)")
        parser.add_argument("--reinstate", action="store_true")

    def handle(self, *args, slug, reason, reinstate, **options):
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"no tenant {slug!r}")
        try:
            if reinstate:
                tenant = tenant_reinstate(tenant=tenant, actor=None, reason=reason)
            else:
                tenant = tenant_suspend(tenant=tenant, actor=None, reason=reason)
        except AccountsError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"tenant {tenant.slug} is {tenant.state}")
