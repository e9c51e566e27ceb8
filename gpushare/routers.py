"""The API's router: DRF's ``DefaultRouter`` with a root view that writes its links once per host.

DRF's root view reverses every collection's URL and builds it absolute on each request (~55 us of CPU for
two links). The links depend only on the scheme, the host the request was made to (already checked against
``ALLOWED_HOSTS``), the URL namespace and the format asked for, so they are kept per such key (at most
``MAX_HOSTS``, least recently used out first).
"""

from __future__ import annotations

from rest_framework import routers
from rest_framework.response import Response

from .caches import LockedLRU

MAX_HOSTS = 64


class ApiRootView(routers.APIRootView):
    _links = LockedLRU(MAX_HOSTS)

    def get(self, request, *args, **kwargs):
        key = (
            tuple(self.api_root_dict.items()),
            request.scheme,
            request.get_host(),
            request.resolver_match.namespace,
            args,
            tuple(sorted(kwargs.items())),
        )
        links = self._links.get(key)
        if links is None:
            links = super().get(request, *args, **kwargs).data
            self._links.put(key, links)
        return Response(dict(links))


class ApiRouter(routers.DefaultRouter):
    APIRootView = ApiRootView
