"""`manage.py close_invoices --month YYYY-MM`: close a month into invoices (idempotent)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from billing.selectors import month_parse
from billing.services.invoices import invoices_close_month
from billing.tasks import invoice_send_task


class Command(BaseCommand):
    help = "Close a month (UTC) into one invoice per tenant with usage. Running it twice changes nothing."

    def add_arguments(self, parser):
        parser.add_argument("--month", required=True, help="the month to close, YYYY-MM")
        parser.add_argument("--send", action="store_true", help="also send the invoices to Stripe (via Celery)")

    def handle(self, *args, month: str, send: bool, **options):
        try:
            first_day = month_parse(month)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        invoices = invoices_close_month(month=first_day)
        for invoice in invoices:
            self.stdout.write(f"{invoice.tenant.slug}\t{invoice.pk}\t{invoice.state}\t{invoice.total}")
            if send:
                invoice_send_task.delay(invoice_id=invoice.pk)
        self.stdout.write(self.style.SUCCESS(f"{len(invoices)} invoice(s) for {first_day:%Y-%m}"))
