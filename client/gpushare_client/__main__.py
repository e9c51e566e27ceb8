"""``python -m gpushare_client``: the ``gpushare`` command line."""

from .cli import main

main()
