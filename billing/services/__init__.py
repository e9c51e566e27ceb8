"""Billing writes. Each service is one transaction; see the modules for the details.

- ingest: usage windows in, rated charges out
- invoices: month close, invoice state transitions
- payments: Stripe (through billing.gateway) and its webhook events
- spend: spend alerts
"""

from .ingest import MAX_WINDOW_MS, WindowRejected, usage_windows_ingest

__all__ = ["MAX_WINDOW_MS", "WindowRejected", "usage_windows_ingest"]
