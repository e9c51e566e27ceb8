"""A node's broker user: what it may read and write, for Redis 7 ACLs and RabbitMQ.

A node's broker credential may consume only its own command queue
(``node.<name>``) and publish only to the report queue (``reports``). It can
neither read another node's commands (they carry tenants' environment
variables) nor restore or read other consumers' unacknowledged messages, nor
write to the platform queue (scheduling passes, invoice close...).

Redis: kombu keeps unacknowledged messages in shared keys (``unacked``,
``unacked_index``, ``unacked_mutex``); the agent uses its own names for them
(agents.agent.brokerconf.node_redis_keys), so the ACL can be exact. The report
list is write-only (``%W~reports``): a node can push a report but not read
anyone's. RabbitMQ: configure/write/read permissions by regular expression.
"""

from __future__ import annotations

import re

from .agent.brokerconf import REPORT_QUEUE, node_queue, node_redis_keys

# Every command kombu's Redis transport issues for a consumer of one queue that also publishes.
REDIS_COMMANDS = (
    "auth hello client select ping info multi exec watch unwatch brpop lpush llen sadd smembers sismember "
    "hset hget hdel zadd zrem zrange zrangebyscore zrevrangebyscore set get del exists expire pexpire rpop "
    "eval evalsha script"
).split()


def redis_user(node: str) -> str:
    return f"gpushare-node-{node}"


def redis_acl_rules(node: str, password: str) -> list[str]:
    """The ``ACL SETUSER <user>`` rules of ``node``'s broker user (one argument each)."""
    queue = node_queue(node)
    own = [queue, f"{queue}\x06\x16*", f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    own += list(node_redis_keys(node).values())
    return [
        "reset",
        "on",
        f">{password}",
        "resetchannels",
        "-@all",
        *(f"+{c}" for c in REDIS_COMMANDS),
        *(f"~{k}" for k in own),
        f"%W~{REPORT_QUEUE}",
    ]


def redis_acl_line(node: str, password: str) -> str:
    """``node``'s user as a line of an ACL file (``aclfile``) or ``ACL SETUSER`` arguments, quoted for redis-cli."""

    def quote(rule: str) -> str:
        return '"' + rule.replace("\x06", "\\x06").replace("\x16", "\\x16") + '"' if "\x06" in rule else rule

    return f"user {redis_user(node)} " + " ".join(quote(r) for r in redis_acl_rules(node, password)[1:])


def rabbitmq_user(node: str) -> str:
    return f"gpushare-node-{node}"


def rabbitmq_permissions(node: str) -> tuple[str, str, str]:
    """``(configure, write, read)`` regular expressions of ``node``'s RabbitMQ user.

    configure: its own queue and exchange (the agent declares them); write: its
    own queue (binding it) and the ``reports`` exchange (publishing), never the
    default exchange, which routes to any queue by name; read: its own queue.
    """
    own = re.escape(node_queue(node))
    return f"^{own}$", f"^({own}|{re.escape(REPORT_QUEUE)})$", f"^{own}$"


def rabbitmq_commands(node: str, password: str, vhost: str = "/") -> list[str]:
    configure, write, read = rabbitmq_permissions(node)
    user = rabbitmq_user(node)
    return [
        f"rabbitmqctl add_user {user} '{password}'",
        f"rabbitmqctl set_permissions -p {vhost} {user} '{configure}' '{write}' '{read}'",
    ]
