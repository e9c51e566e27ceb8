from rest_framework.routers import DefaultRouter

from .arrays import JobArrayViewSet
from .views import JobViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("arrays", JobArrayViewSet, basename="job-array")
urlpatterns = [*router.urls]  # quota/: admission/urls.py
