from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from accounts.models import Tenant
from accounts.services import ALL_SCOPES, DEFAULT_SCOPES, token_create


class Command(BaseCommand):
    help = "Issue an API token for a tenant member; the token is printed once, on the last line."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--user", required=True, help="the member's username (email)")
        parser.add_argument("--name", required=True)
        parser.add_argument("--scopes", nargs="+", default=list(DEFAULT_SCOPES), choices=ALL_SCOPES)
        parser.add_argument("--expires", type=int, default=None, metavar="DAYS")

    def handle(self, *args, tenant, user, name, scopes, expires, **options):
        found_tenant = Tenant.objects.filter(slug=tenant).first()
        if found_tenant is None:
            raise CommandError(f"no tenant {tenant!r}")
        found_user = get_user_model().objects.filter(username=user).first()
        if found_user is None:
            raise CommandError(f"no user {user!r}")
        if expires is not None and expires <= 0:
            raise CommandError("--expires takes a positive number of days")
        try:
            issued = token_create(tenant=found_tenant, user=found_user, name=name, scopes=scopes, expires_days=expires)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"token {issued.token.prefix}… for {user} @ {tenant}, scopes {' '.join(scopes)}")
        self.stdout.write(issued.plaintext)
