import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
django.setup(set_prefix=False)

from gpushare.lanes import Lanes  # noqa: E402  (after setup: it builds the middleware chains)

application = Lanes()
