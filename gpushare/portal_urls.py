"""Portal pages (the self-service portal issue grows these)."""

from django.http import HttpResponse
from django.urls import path


def home(request):
    return HttpResponse(
        "<h1>gpushare</h1><p>The portal is being built. API: <a href='/api/docs/'>/api/docs/</a>, "
        "operator console: <a href='/admin/'>/admin/</a>.</p>"
    )


urlpatterns = [path("", home, name="home")]
