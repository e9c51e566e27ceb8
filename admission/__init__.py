"""The admission layer: whether a tenant may start something, in one place that fails closed.

Above ``scheduler``, ``billing`` and ``endpoints`` (``.importlinter``); they reach it only
through the ports it provides at start-up (``admission.apps``). See docs/accounts.md.

    accounts/limits.py  the arithmetic (no Django): limits, refusals, holds
    selectors.py        month usage, open holds, budget status, the scheduler's caps
    services.py         admission checks (jobs, endpoints), month totals, the budget beat
    throttling.py       API requests per tenant per minute, shared through the cache
"""
