from django.urls import path
from rest_framework.routers import DefaultRouter

from .quota import QuotaView
from .views import JobViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
urlpatterns = [*router.urls, path("quota/", QuotaView.as_view(), name="quota")]
