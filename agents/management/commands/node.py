from django.core.management.base import BaseCommand, CommandError

from agents.models import Gpu, Node
from agents.services import NodeStateError, gpu_move, gpu_return_to_service, node_cordon, node_drain, node_uncordon


class Command(BaseCommand):
    help = (
        "Operator commands for a node: cordon (no new jobs), drain (no new jobs; cordoned once its jobs end), "
        "uncordon (back in the pool), return-gpu UUID (a GPU taken out of service goes back into the pool), "
        "move-gpu UUID --to NODE (a card moved to another server: a GPU UUID stays with the node that registered it "
        "first until an operator moves it)."
    )

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["cordon", "drain", "uncordon", "return-gpu", "move-gpu", "show"])
        parser.add_argument("name", help="node name (return-gpu: the GPU's uuid)")
        parser.add_argument("--reason", default="")
        parser.add_argument("--to", default="", help="move-gpu: the node the GPU now belongs to")

    def handle(self, *args, action, name, reason, to, **options):
        try:
            if action == "move-gpu":
                gpu, target = Gpu.objects.filter(uuid=name).first(), Node.objects.filter(name=to).first()
                if gpu is None or target is None:
                    raise CommandError(f"no GPU with uuid {name!r}" if gpu is None else f"no node named {to!r}")
                gpu = gpu_move(gpu=gpu, to=target)
                self.stdout.write(f"GPU {gpu.uuid} now belongs to {target.name}; its agent registers it next time")
                return
            if action == "return-gpu":
                gpu = Gpu.objects.filter(uuid=name).first()
                if gpu is None:
                    raise CommandError(f"no GPU with uuid {name!r}")
                gpu = gpu_return_to_service(gpu=gpu, note=reason)
                self.stdout.write(f"GPU {gpu.uuid} on {gpu.node.name}: back in service")
                return
            node = Node.objects.filter(name=name).first()
            if node is None:
                known = ", ".join(Node.objects.values_list("name", flat=True)) or "none"
                raise CommandError(f"no node named {name!r} (known: {known})")
            if action == "cordon":
                node = node_cordon(node=node, reason=reason)
            elif action == "drain":
                node = node_drain(node=node, reason=reason)
            elif action == "uncordon":
                node = node_uncordon(node=node)
        except NodeStateError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"node {node.name}: {node.state}" + (f" ({node.state_reason})" if node.state_reason else ""))
        for gpu in node.gpus.all():
            self.stdout.write(f"  GPU {gpu.index} {gpu.uuid} {gpu.model} {gpu.health} {gpu.health_reason}")
