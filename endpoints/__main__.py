"""``python -m endpoints``: run the endpoint gateway."""

from endpoints.gateway import main

main()
