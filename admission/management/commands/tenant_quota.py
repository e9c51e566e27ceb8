from dataclasses import asdict
from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError

from accounts.models import Plan, RunningJobsPolicy, Tenant
from accounts.services import QUOTA_FIELDS, AccountsError, quota_set
from admission.selectors import budget_status

DECIMALS = {"gpu_hours_per_month", "monthly_spend_limit"}
CHOICES = {"on_budget_exhausted", "on_suspended"}


def _decimal(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation as exc:
        raise CommandError(f"{text!r} is not a number") from exc


class Command(BaseCommand):
    help = "Show or set a tenant's plan and quota overrides; prints the effective limits and the month's use."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--plan", help="plan name ('-' for none: the default plan)")
        for name in QUOTA_FIELDS:
            flag = "--" + name.replace("_", "-")
            if name in CHOICES:
                parser.add_argument(flag, dest=name, choices=RunningJobsPolicy.values)
            elif name in DECIMALS:
                parser.add_argument(flag, dest=name, type=_decimal)
            else:
                parser.add_argument(flag, dest=name, type=int)
        parser.add_argument(
            "--clear", nargs="+", default=[], choices=QUOTA_FIELDS, help="overrides to drop (back to the plan's)"
        )

    def handle(self, *args, slug, plan, clear, **options):
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"no tenant {slug!r}")
        changes = {name: options[name] for name in QUOTA_FIELDS if options.get(name) is not None}
        changes.update({name: None for name in clear})
        kwargs = {}
        if plan is not None:
            kwargs["plan"] = None if plan == "-" else Plan.objects.filter(name=plan).first()
            if plan != "-" and kwargs["plan"] is None:
                raise CommandError(
                    f"no plan {plan!r} (known: {', '.join(Plan.objects.values_list('name', flat=True))})"
                )
        if changes or kwargs:
            try:
                quota_set(tenant=tenant, actor=None, **kwargs, **changes)
            except AccountsError as exc:
                raise CommandError(str(exc)) from exc
        status = budget_status(tenant)
        for name, value in asdict(status.limits).items():
            self.stdout.write(f"{name}: {'no limit' if value is None else value}")
        self.stdout.write(
            f"this month: {status.gpu_hours_used} GPU-hours, spend {status.usage.spend:.2f}"
            + (" (budget exhausted)" if status.exhausted else " (alert)" if status.alert else "")
        )
