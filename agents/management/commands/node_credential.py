import secrets

from django.core.management.base import BaseCommand

from agents.brokeracl import rabbitmq_commands, redis_acl_line, redis_user
from agents.nodelink import trusted_keys
from agents.services import node_credential_issue


class Command(BaseCommand):
    help = (
        "Create a node (or re-key it): print its broker user's Redis ACL line and RabbitMQ permissions, "
        "the platform's public keys its agent trusts, and the agent's token once, on the last line."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--broker-password", default="", help="the node's broker password (default: a new random one)"
        )
        parser.add_argument("--vhost", default="/", help="RabbitMQ virtual host")

    def handle(self, *args, name, broker_password, vhost, **options):
        password = broker_password or secrets.token_urlsafe(24)
        token = node_credential_issue(name=name)
        w = self.stdout.write
        w(f"node {name}: its broker user may read only its queue node.{name} and write only the report queue.")
        w(f"Redis 7 (add to the ACL file, or `redis-cli ACL SETUSER {redis_user(name)} ...` with the same rules):")
        w("  " + redis_acl_line(name, password))
        w(f"  agent broker URL: redis://{redis_user(name)}:{password}@<redis host>:6379/<db>")
        w("RabbitMQ:")
        for line in rabbitmq_commands(name, password, vhost):
            w("  " + line)
        w(f"  agent broker URL: amqp://{redis_user(name)}:{password}@<rabbitmq host>:5672/{vhost.lstrip('/')}")
        w("Platform public keys the agent verifies commands with (GPUSHARE_NODELINK_PUBLIC_KEY_FILE):")
        for key in trusted_keys():
            w("  " + key)
        w(f"node {name}: give this token to its agent (--token-file or GPUSHARE_AGENT_TOKEN)")
        w(token)
