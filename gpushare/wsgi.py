import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
django.setup(set_prefix=False)

from django.urls import get_resolver  # noqa: E402

from gpushare.heap import heap_settle  # noqa: E402
from gpushare.lanes import Lanes  # noqa: E402  (after setup: it builds the middleware chains)

application = Lanes()
get_resolver().url_patterns  # noqa: B018 - every view, serializer and form imported now, not at a request
heap_settle()  # what the process keeps, out of the garbage collector's full walks (gpushare/heap.py)
