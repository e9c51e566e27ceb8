"""`manage.py ledger_check --month YYYY-MM`: every GPU-second accounted for, or a loud non-zero exit."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django_scopes import scopes_disabled

from billing.selectors import ledger_month, month_parse

MS_PER_HOUR = 3_600_000


def hours(milli_gpu_ms: int) -> str:
    return f"{milli_gpu_ms / 1000 / MS_PER_HOUR:,.3f}"


class Command(BaseCommand):
    help = (
        "For every GPU and every second of a month: held + idle + out-of-service = its seconds in the month. "
        "Prints utilisation, revenue and idle capacity per GPU model and per node; exits 1 on any gap or overlap."
    )

    def add_arguments(self, parser):
        parser.add_argument("--month", required=True, help="YYYY-MM (UTC)")

    @scopes_disabled()  # the operator's check of every tenant's month
    def handle(self, *args, month: str, **options):
        try:
            first_day = month_parse(month)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        report = ledger_month(month=first_day, until=timezone.now())
        out = self.stdout
        out.write(f"GPU ledger for {first_day:%Y-%m} (GPU-hours)")
        for title, rows in (("GPU model", report.by_model), ("node", report.by_node)):
            out.write(
                f"\n{title:<20} {'gpus':>5} {'capacity':>12} {'held':>12} {'idle':>12} {'out':>10} "
                f"{'util':>7} {'revenue':>12}"
            )
            for r in rows:
                util = f"{r.utilisation:.1%}" if r.utilisation is not None else "-"
                out.write(
                    f"{r.key:<20} {r.gpus:>5} {hours(r.capacity):>12} {hours(r.held):>12} {hours(r.idle):>12} "
                    f"{hours(r.out_of_service):>10} {util:>7} {r.revenue:>12.2f}"
                )
        unbalanced = [g for g in report.gpus if g.held + g.idle + g.out_of_service != g.capacity or g.idle < 0]
        if report.problems or unbalanced:
            for problem in report.problems:
                self.stderr.write(self.style.ERROR(problem))
            raise CommandError(
                f"ledger check FAILED for {first_day:%Y-%m}: {len(report.problems)} problem(s), "
                f"{len(unbalanced)} GPU(s) whose seconds do not add up"
            )
        out.write(self.style.SUCCESS(f"\nledger check passed: {len(report.gpus)} GPU(s), every second accounted for"))
