from gpushare.routers import ApiRouter

from .arrays import JobArrayViewSet
from .views import JobViewSet

router = ApiRouter()  # DRF's DefaultRouter, its root's links written once per host
router.register("jobs", JobViewSet, basename="job")
router.register("arrays", JobArrayViewSet, basename="job-array")
urlpatterns = [*router.urls]  # quota/: admission/urls.py
