from rest_framework.routers import SimpleRouter

from .views import EndpointViewSet

router = SimpleRouter()
router.register("endpoints", EndpointViewSet, basename="endpoint")
urlpatterns = router.urls
