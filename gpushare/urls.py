from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from gpushare.api_edges import api_not_found

# /api/ paths answer Django-level errors in the API's error shape (gpushare/api.py).
handler400 = "gpushare.api.bad_request"
handler403 = "gpushare.api.permission_denied"
handler404 = "gpushare.api.page_not_found"
handler500 = "gpushare.api.server_error"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("console/", include("console.urls")),
    path("accounts/", include("accounts.urls")),
    path("api/v1/", include("scheduler.api.urls")),
    path("api/v1/", include("billing.api.urls")),
    path("api/v1/", include("agents.api.urls")),
    path("api/v1/", include("endpoints.api.urls")),
    path("billing/", include("billing.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularRedocView.as_view(url_name="schema"), name="api-docs"),
    path("api/docs/try/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs-try"),
    re_path(r"^api/(?P<rest>.*)$", api_not_found),  # keep last of the /api/ patterns: unknown paths, error shape
    path("", include("portal.urls")),
]
