import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
django.setup(set_prefix=False)

from gpushare.heap import heap_settle  # noqa: E402
from gpushare.lanes import Lanes  # noqa: E402  (after setup: it builds the middleware chains)

application = Lanes()
heap_settle()  # what the process keeps, out of the garbage collector's full walks (gpushare/heap.py)
