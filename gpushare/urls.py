from csp.decorators import csp_update
from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerSplitView

from gpushare.api_edges import api_not_found

# Redoc and Swagger UI inject their own <style> elements and run workers from blob: URLs;
# only their two pages get that (Swagger's init script is a file: the "split" view).
docs_csp = csp_update({"style-src": ["'unsafe-inline'"], "worker-src": ["blob:"], "img-src": ["blob:"]})


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
    path("api/v1/", include("admission.urls")),
    path("billing/", include("billing.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", docs_csp(SpectacularRedocView.as_view(url_name="schema")), name="api-docs"),
    path("api/docs/try/", docs_csp(SpectacularSwaggerSplitView.as_view(url_name="schema")), name="api-docs-try"),
    re_path(r"^api/(?P<rest>.*)$", api_not_found),  # keep last of the /api/ patterns: unknown paths, error shape
    path("", include("portal.urls")),
]
