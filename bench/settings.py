"""The production settings plus one URL: ``/bench/bare/``, a bare Django view (no authentication,
DRF, database or cache) that is the web server's own ceiling in the api benchmark."""

from gpushare.settings.production import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
