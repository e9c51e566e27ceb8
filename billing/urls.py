from django.urls import path

from . import views

app_name = "billing"
urlpatterns = [
    path("stripe/webhook/", views.stripe_webhook, name="stripe-webhook"),
    path("invoices/<int:invoice_id>/", views.invoice_detail, name="invoice-detail"),
    path("invoices/<int:invoice_id>/jobs.csv", views.invoice_csv, name="invoice-csv"),
    path("ledger/", views.ledger_report, name="ledger"),
]
