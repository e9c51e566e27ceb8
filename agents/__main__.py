"""``python -m agents``: run the node agent."""

from agents.agent.main import main

main()
