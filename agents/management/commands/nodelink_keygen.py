from django.core.management.base import BaseCommand, CommandError

from agents import nodelink


class Command(BaseCommand):
    help = (
        "The platform's command-signing key (Ed25519): create it, or rotate it in two steps "
        "(--stage a next key, give agents both public keys, then --promote it). Prints the public keys "
        "agents must trust (their GPUSHARE_NODELINK_PUBLIC_KEY_FILE)."
    )

    def add_arguments(self, parser):
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--public", action="store_true", help="only print the public keys agents trust now")
        group.add_argument("--stage", action="store_true", help="rotation step 1: create the next key")
        group.add_argument("--promote", action="store_true", help="rotation step 2: sign with the next key from now on")
        group.add_argument(
            "--finish", action="store_true", help="rotation step 3: stop listing the retired key as trusted"
        )

    def handle(self, *args, public, stage, promote, finish, **options):
        folder = nodelink.key_dir()
        current, following = folder / nodelink.SIGNING, folder / nodelink.NEXT
        if public:
            keys = nodelink.trusted_keys()
        elif stage:
            if not current.exists():
                raise CommandError("no signing key yet: run nodelink_keygen first")
            nodelink.key_create(nodelink.NEXT)
            keys = nodelink.trusted_write()
            self.stderr.write("staged the next key: give the agents BOTH public keys below, then run --promote")
        elif promote:
            if not following.exists():
                raise CommandError("no staged key: run nodelink_keygen --stage first")
            retired = nodelink.public_text(nodelink._read_private(current))
            following.replace(current)
            keys = nodelink.trusted_write(extra=[retired])
            self.stderr.write(
                "commands are now signed with the new key; once every agent has the new public key alone, run --finish"
            )
        elif finish:
            keys = nodelink.trusted_write()
        else:
            existed = current.exists()
            nodelink.key_create(nodelink.SIGNING)
            keys = nodelink.trusted_keys() if existed else nodelink.trusted_write()
            self.stderr.write(f"signing key {'kept' if existed else 'created'} at {current} (mode 0600)")
        for key in keys:
            self.stdout.write(key)
