"""Login brute-force protection (django-axes) in front of Django's ModelBackend."""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend


class LoginLockoutBackend(AxesStandaloneBackend):
    """Counts and locks out web logins (which always carry the request).

    ``authenticate()`` without a request (management commands, the test
    client's ``login()``) is not a web login: it is passed on to the next
    backend instead of raising, as the stock axes backend does.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)
