from django.urls import path
from rest_framework.routers import SimpleRouter

from .views import EstimateView, InvoiceViewSet, SpendView, UsageView

router = SimpleRouter()
router.register("invoices", InvoiceViewSet, basename="invoice")
urlpatterns = [
    path("usage/", UsageView.as_view(), name="usage"),
    path("spend/", SpendView.as_view(), name="spend"),
    path("estimate/", EstimateView.as_view(), name="estimate"),
    *router.urls,
]
