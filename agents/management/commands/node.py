from django.core.management.base import BaseCommand, CommandError

from agents.models import Gpu, Node
from agents.services import NodeStateError, gpu_return_to_service, node_cordon, node_drain, node_uncordon


class Command(BaseCommand):
    help = (
        "Operator commands for a node: cordon (no new jobs), drain (no new jobs; cordoned once its jobs end), "
        "uncordon (back in the pool), return-gpu UUID (a GPU taken out of service goes back into the pool)."
    )

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["cordon", "drain", "uncordon", "return-gpu", "show"])
        parser.add_argument("name", help="node name (return-gpu: the GPU's uuid)")
        parser.add_argument("--reason", default="")

    def handle(self, *args, action, name, reason, **options):
        try:
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
