from django.urls import path

from . import views

app_name = "billing"
urlpatterns = [
    path("stripe/webhook/", views.stripe_webhook, name="stripe-webhook"),
    # The tenant's invoice pages (/billing/invoices/<id>/, .../jobs.csv) are portal pages: portal/views/invoices.py.
    # The operator's printable invoice is in the admin: /admin/billing/invoice/<id>/print/ (billing/admin.py).
    path("ledger/", views.ledger_report, name="ledger"),
]
