from django.urls import path
from rest_framework.routers import DefaultRouter

from .arrays import JobArrayViewSet
from .quota import QuotaView
from .views import JobViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("arrays", JobArrayViewSet, basename="job-array")
urlpatterns = [*router.urls, path("quota/", QuotaView.as_view(), name="quota")]
