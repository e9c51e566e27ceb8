"""Portal pages, mounted at the site root."""

from django.urls import path, re_path

from .views import common, dashboard, endpoints, invoices, jobs, team, usage, webhooks

app_name = "portal"

urlpatterns = [
    path("", dashboard.dashboard, name="dashboard"),
    path("dashboard/live/", dashboard.dashboard_live, name="dashboard_live"),
    path("tenant/", common.tenant_switch, name="tenant_switch"),
    path("jobs/", jobs.job_list, name="jobs"),
    path("jobs/cancel/", jobs.job_bulk_cancel, name="jobs_cancel"),
    path("jobs/arrays/<int:jobarray_id>/cancel/", jobs.job_array_cancel, name="array_cancel"),
    path("jobs/new/", jobs.job_submit, name="submit"),
    path("jobs/new/check/", jobs.job_submit_check, name="submit_check"),
    path("jobs/<int:pk>/", jobs.job_detail, name="job"),
    path("jobs/<int:pk>/live/", jobs.job_live, name="job_live"),
    path("jobs/<int:pk>/log/", jobs.job_log, name="job_log"),
    path("jobs/<int:pk>/metrics/", jobs.job_metrics, name="job_metrics"),
    path("jobs/<int:pk>/cancel/", jobs.job_cancel, name="job_cancel"),
    path("endpoints/", endpoints.endpoint_list, name="endpoints"),
    path("endpoints/new/", endpoints.endpoint_create, name="endpoint_create"),
    path("endpoints/<int:pk>/", endpoints.endpoint_detail, name="endpoint"),
    path("endpoints/<int:pk>/edit/", endpoints.endpoint_edit, name="endpoint_edit"),
    path("endpoints/<int:pk>/scale/", endpoints.endpoint_scale, name="endpoint_scale"),
    path("endpoints/<int:pk>/delete/", endpoints.endpoint_delete, name="endpoint_delete"),
    path("endpoints/<int:pk>/series/", endpoints.endpoint_series, name="endpoint_series"),
    path("webhooks/", webhooks.webhook_list, name="webhooks"),
    path("webhooks/<int:pk>/", webhooks.webhook_detail, name="webhook"),
    re_path(
        r"^webhooks/(?P<pk>[0-9]+)/(?P<action>ping|rotate|enable|disable|delete)/$",
        webhooks.webhook_action,
        name="webhook_action",
    ),
    path("webhooks/<int:pk>/deliveries/<int:delivery_pk>/resend/", webhooks.delivery_resend, name="delivery_resend"),
    path("usage/", usage.usage, name="usage"),
    path("billing/invoices/<int:invoice_id>/", invoices.invoice_detail, name="invoice"),
    path("billing/invoices/<int:invoice_id>/jobs.csv", invoices.invoice_csv, name="invoice_csv"),
    path("usage/payment-method/", usage.payment_method, name="payment_method"),
    path("team/", team.team, name="team"),
    path("team/tokens/", team.token_create, name="token_create"),
    path("team/tokens/<int:pk>/revoke/", team.token_revoke, name="token_revoke"),
    path("team/invite/", team.member_invite, name="member_invite"),
    path("team/members/<int:pk>/role/", team.member_role, name="member_role"),
    path("team/members/<int:pk>/remove/", team.member_remove, name="member_remove"),
]
