"""Closing a month into invoices, and the invoice state machine."""

from __future__ import annotations

import logging
from datetime import date
from decimal import Decimal

from django.db import DatabaseError, connection, transaction
from django.db.models import Sum
from django.utils import timezone
from django_scopes import scopes_disabled
from psycopg2.extras import execute_values

from accounts.models import Tenant
from accounts.tenancy import acts_for_tenant
from webhooks import emit as webhook_emit

from .. import rating
from ..models import INVOICE_TRANSITIONS, Charge, ChargeBatch, Invoice, InvoiceLine

log = logging.getLogger(__name__)

LINE_KEY = ("gpu_model", "mode", "priority_class", "rate_per_gpu_hour")


class InvoiceError(ValueError):
    pass


def invoice_transition(invoice: Invoice, to_state: str, *, save_fields: tuple[str, ...] = ()) -> None:
    """Move ``invoice`` to ``to_state`` if the state machine allows it (the caller holds the row lock)."""
    if to_state not in INVOICE_TRANSITIONS[invoice.state]:
        raise InvoiceError(f"invoice {invoice.pk} cannot go from {invoice.state} to {to_state}")
    invoice.state = to_state
    invoice.save(update_fields=["state", *save_fields])
    webhook_emit.invoice_state_changed(invoice)


@acts_for_tenant
@transaction.atomic
def invoice_close(*, tenant: Tenant, month: date) -> Invoice | None:
    """Turn the tenant's uninvoiced charges up to ``month`` into that month's invoice.

    Idempotent: if the month already has an invoice it is returned unchanged
    (charges that arrive later go on the next month's invoice). A tenant with
    no charges gets no invoice. Lines: one per GPU model × mode × priority
    class × rate; each line's exact amount is rounded once, half up to cents,
    and the total is the sum of the rounded lines.
    """
    month = month.replace(day=1)
    closed = _close(month=month, tenant_ids=[tenant.pk]).get(tenant.pk)
    return closed or Invoice.objects.filter(tenant=tenant, month=month).first()


@scopes_disabled()  # the month's close: every tenant's charges, set-based
def invoices_close_month(*, month: date) -> list[Invoice]:
    """Close ``month`` for every tenant with uninvoiced charges, set-based (see ``invoice_close``).

    All tenants are closed in one transaction with a fixed number of queries.
    If that fails (one tenant's figures break a constraint, say), each tenant
    is closed in a transaction of its own so one tenant's failure loses no
    other's invoice; the failure is logged and that tenant is left for the
    next run.
    """
    month = month.replace(day=1)
    try:
        with transaction.atomic():
            closed = _close(month=month, tenant_ids=None)
    except DatabaseError:
        log.exception("closing %s for all tenants at once failed; closing tenant by tenant", f"{month:%Y-%m}")
        closed = {}
        for tenant_id in _pending_tenant_ids(month):
            try:
                with transaction.atomic():
                    closed.update(_close(month=month, tenant_ids=[tenant_id]))
            except DatabaseError:
                log.exception("closing %s for tenant %s failed", f"{month:%Y-%m}", tenant_id)
    return [closed[pk] for pk in sorted(closed)]


def _pending_tenant_ids(month: date) -> list[int]:
    """Tenants with uninvoiced charges up to ``month`` (batched or not yet)."""
    batched = ChargeBatch.objects.filter(invoice__isnull=True, month__lte=month).values_list("tenant_id", flat=True)
    unbatched = Charge.objects.filter(batch__isnull=True, month__lte=month).values_list("tenant_id", flat=True)
    return sorted(set(batched) | set(unbatched))


def _charges_adopt(month: date, tenant_ids: list[int] | None) -> None:
    """Put charges written outside ingest (no batch) up to ``month`` into batches of their own."""
    stray = Charge.objects.filter(batch__isnull=True, month__lte=month)
    if tenant_ids is not None:
        stray = stray.filter(tenant_id__in=tenant_ids)
    keys = set(stray.values_list("tenant_id", "month"))
    for batch in ChargeBatch.objects.bulk_create(ChargeBatch(tenant_id=t, month=m) for t, m in sorted(keys)):
        stray.filter(tenant_id=batch.tenant_id, month=batch.month).update(batch=batch)


def _close(*, month: date, tenant_ids: list[int] | None) -> dict[int, Invoice]:
    """Close ``month`` for ``tenant_ids`` (None: every tenant with uninvoiced charges); the caller's transaction.

    Returns {tenant id: invoice} for each tenant that had uninvoiced charges:
    the new invoice, or the month's existing one (left unchanged). A fixed
    number of statements whatever the number of tenants and charges.
    """
    _charges_adopt(month, tenant_ids)
    pending = ChargeBatch.objects.filter(invoice__isnull=True, month__lte=month)
    if tenant_ids is not None:
        pending = pending.filter(tenant_id__in=tenant_ids)
    # Lock the tenants in id order: serialises concurrent closes without deadlocks.
    tenants = list(Tenant.objects.select_for_update().filter(pk__in=pending.values("tenant_id")).order_by("pk"))
    if not tenants:
        return {}
    closed = {i.tenant_id: i for i in Invoice.objects.filter(tenant__in=tenants, month=month)}
    fresh = Invoice.objects.bulk_create(
        Invoice(tenant=t, month=month, stripe_customer_id=t.stripe_customer_id) for t in tenants if t.pk not in closed
    )
    if not fresh:
        return closed
    by_tenant = {i.tenant_id: i for i in fresh}
    lines = [_line(by_tenant[g[0]], g[1:]) for g in _batches_mark(month, by_tenant)]
    _lines_insert(lines)
    # A concurrent close of a later month may have taken a tenant's batches
    # between our look and our lock: no lines, no invoice.
    empty = set(by_tenant) - {line.tenant_id for line in lines}
    if empty:
        Invoice.objects.filter(pk__in=[by_tenant[t].pk for t in empty]).delete()
        fresh = [i for i in fresh if i.tenant_id not in empty]
    totals: dict[int, Decimal] = {i.pk: Decimal("0.00") for i in fresh}
    for line in lines:
        totals[line.invoice_id] += line.amount
    now = timezone.now()
    for invoice in fresh:
        invoice.total = totals[invoice.pk]
        if invoice.total == 0:
            if Invoice.State.PAID not in INVOICE_TRANSITIONS[invoice.state]:
                raise InvoiceError(f"invoice {invoice.pk} cannot go from {invoice.state} to paid")
            invoice.state, invoice.paid_at = Invoice.State.PAID, now
    _totals_save(fresh)
    log.info("%s closed: %d new invoices, %s in all", f"{month:%Y-%m}", len(fresh), sum(totals.values()))
    return closed | {i.tenant_id: i for i in fresh}


def _batches_mark(month: date, invoices: dict[int, Invoice]) -> list[tuple]:
    """Put the tenants' uninvoiced batches up to ``month`` on their new invoices; the lines' sums of what was marked.

    The UPDATE returns the batches it marked and the sums are over exactly
    those batches' charges: a batch is committed with all its charges and
    ingest never adds to an existing one, so a batch committed meanwhile is
    neither marked nor summed (it waits for the next invoice). Rows:
    (tenant id, *LINE_KEY, gpu_ms, sm_util_ms, memory_mb_ms, energy_mj, exact amount).
    """
    sums = ("gpu_ms", "sm_util_ms", "memory_mb_ms", "energy_mj", "amount")
    if connection.vendor != "postgresql":  # the SQLite demo: the same through the ORM
        for tenant_id, invoice in invoices.items():
            batches = ChargeBatch.objects.filter(tenant_id=tenant_id, invoice__isnull=True, month__lte=month)
            batches.update(invoice=invoice)
        charges = Charge.objects.filter(batch__invoice__in=list(invoices.values()))
        rows = charges.values_list("tenant_id", *LINE_KEY).annotate(*[Sum(f) for f in sums])
        return list(rows.order_by())
    key = ", ".join(("tenant_id", *LINE_KEY))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE billing_chargebatch b SET invoice_id = i.id FROM billing_invoice i "
            "WHERE i.id = ANY(%s) AND b.tenant_id = i.tenant_id AND b.invoice_id IS NULL AND b.month <= %s "
            "RETURNING b.id",
            [[i.pk for i in invoices.values()], month],
        )
        marked = [batch_id for (batch_id,) in cursor.fetchall()]
        cursor.execute(
            f"SELECT {key}, {', '.join(f'SUM({f})' for f in sums)} FROM billing_charge "
            f"WHERE batch_id = ANY(%s) GROUP BY {key}",
            [marked],
        )
        return cursor.fetchall()


_LINE_COLUMNS = (
    "tenant_id", "invoice_id", "gpu_model", "mode", "priority_class", "rate_per_gpu_hour", "gpu_ms", "sm_util_ms",
    "memory_mb_ms", "energy_mj", "exact_amount", "amount", "stripe_item_id",
)  # fmt: skip


def _lines_insert(lines: list[InvoiceLine]) -> None:
    """One multi-row INSERT of plain tuples (the ORM's bulk_create spends more building than PostgreSQL inserting)."""
    if connection.vendor != "postgresql":
        InvoiceLine.objects.bulk_create(lines)
        return
    with connection.cursor() as cursor, connection.wrap_database_errors:
        execute_values(
            cursor.cursor,
            f"INSERT INTO billing_invoiceline ({', '.join(_LINE_COLUMNS)}) VALUES %s",
            [tuple(getattr(line, c) for c in _LINE_COLUMNS) for line in lines],
            page_size=max(1, len(lines)),
        )


def _totals_save(invoices: list[Invoice]) -> None:
    """Store the new invoices' totals and states in one UPDATE (the ORM's bulk_update is slow to build)."""
    if connection.vendor != "postgresql":
        Invoice.objects.bulk_update(invoices, ["total", "state", "paid_at"])
        return
    with connection.cursor() as cursor, connection.wrap_database_errors:
        execute_values(
            cursor.cursor,
            "UPDATE billing_invoice i SET total = v.total, state = v.state, paid_at = v.paid_at "
            "FROM (VALUES %s) AS v (id, total, state, paid_at) WHERE i.id = v.id",
            [(i.pk, i.total, i.state, i.paid_at) for i in invoices],
            template="(%s, %s::numeric, %s, %s::timestamptz)",
            page_size=max(1, len(invoices)),
        )


def _line(invoice: Invoice, group: tuple) -> InvoiceLine:
    gpu_model, mode, priority_class, rate, gpu_ms, sm, mem, energy, exact = group
    return InvoiceLine(
        tenant_id=invoice.tenant_id,
        invoice=invoice,
        gpu_model=gpu_model,
        mode=mode,
        priority_class=priority_class,
        rate_per_gpu_hour=rate,
        gpu_ms=gpu_ms,
        sm_util_ms=sm,
        memory_mb_ms=mem,
        energy_mj=energy,
        exact_amount=exact,
        amount=rating.line_round(exact),
    )


@acts_for_tenant("invoice")
@transaction.atomic
def invoice_void(*, invoice: Invoice, reason: str = "") -> Invoice:
    """Void an unpaid invoice; its charges go back to uninvoiced (the next close picks them up)."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    invoice.failure_message = reason[:300]
    invoice_transition(invoice, Invoice.State.VOID, save_fields=("failure_message",))
    ChargeBatch.objects.filter(invoice=invoice).update(invoice=None)
    return invoice
