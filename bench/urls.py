"""gpushare's URLs and the api benchmark's ceiling: a bare Django view (middleware only)."""

from django.http import HttpResponse
from django.urls import include, path


def bare(request):
    return HttpResponse(b'{"ok":true}', content_type="application/json")


urlpatterns = [path("bench/bare/", bare), path("", include("gpushare.urls"))]

handler400 = "gpushare.api.bad_request"
handler403 = "gpushare.api.permission_denied"
handler404 = "gpushare.api.page_not_found"
handler500 = "gpushare.api.server_error"
