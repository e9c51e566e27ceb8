"""The self-service portal: the pages a tenant's engineers use in the browser.

Pages (portal/urls.py, mounted at the site root, namespace ``portal``):
dashboard (``/``), jobs list (``/jobs/``), submit (``/jobs/new/``), job detail
(``/jobs/<id>/``), usage and billing (``/usage/``), team and tokens (``/team/``).
Live parts are small htmx partials polled by the page (``dashboard/live/``,
``jobs/<id>/live/``, ``jobs/<id>/log/``) plus a JSON feed for the charts
(``jobs/<id>/metrics/``); each stops polling once its job has ended.

Every view is wrapped by ``tenancy.tenant_page``: log-in required, tenant taken
from the user's memberships (the choice kept in the session), the request run
inside that tenant's django-scopes scope (another tenant's object is a 404), and
the role checked against accounts.permissions. Writes go through the services
of the other apps (scheduler.services.job_submit/job_cancel, accounts.services,
billing.services.payments); reads are in ``selectors.py``. The submit form
validates through the API's JobCreateSerializer, so it shows the API's messages.

Front end: one stylesheet (static/css/gpushare.css), htmx from django-htmx's
static files, Chart.js vendored into static/vendor/ from the exact version pinned
in portal/frontend/package.json (``cd portal/frontend && npm ci && npm run
vendor``; the copied file is committed, nothing is fetched at run time).
"""
