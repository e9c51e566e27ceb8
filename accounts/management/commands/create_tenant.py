from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from accounts.models import Tenant
from accounts.services import tenant_create


class Command(BaseCommand):
    help = "Create a tenant and its owner (a user named by email)."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--owner", required=True, help="owner's email (also the login name)")
        parser.add_argument("--password", help="owner's password (omit for an existing user)")
        parser.add_argument("--name", default="", help="display name (defaults to the slug)")

    def handle(self, *args, slug, owner, password, name, **options):
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"tenant {slug!r} already exists")
        try:
            tenant = tenant_create(slug=slug, name=name, owner_email=owner, owner_password=password)
        except IntegrityError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"created tenant {tenant.slug} (owner {owner})")
