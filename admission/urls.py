from django.urls import path

from .api import QuotaView

urlpatterns = [path("quota/", QuotaView.as_view(), name="quota")]
