from django.core.management.base import BaseCommand

from agents.services import node_credential_issue


class Command(BaseCommand):
    help = "Create a node (or re-key it) and print the agent's token once, on the last line."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name, **options):
        token = node_credential_issue(name=name)
        self.stdout.write(f"node {name}: give this token to its agent (--token or GPUSHARE_AGENT_TOKEN)")
        self.stdout.write(token)
