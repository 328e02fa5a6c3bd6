"""The `ddpjob` command: one entry point, a subcommand per part of the project.

Each subcommand lives in its own module of ddp_operator.commands, named after it, exposing
``configure_parser(parser)`` and ``main(args) -> int``; heavy imports wait until its ``main`` runs, so
`ddpjob run` never pays for kopf and `ddpjob operator` never pays for torch. The local test cluster is
not here: it is the harness's own command, `ddp-harness cluster`, outside the product.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ddp_operator import __version__

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("ddp_operator.commands.run", "run a DDPJob manifest as local processes, no cluster needed"),
    "operator": ("ddp_operator.commands.operator", "run the DDPJob operator (kopf) against a cluster"),
    "get": ("ddp_operator.commands.get", "list DDPJobs with their phase, progress and straggler"),
    "describe": (
        "ddp_operator.commands.describe",
        "show one DDPJob: conditions, last restart, rank pods, Events",
    ),
    "logs": ("ddp_operator.commands.logs", "print or follow a rank's log across restarts and replaced pods"),
    "top": ("ddp_operator.commands.top", "each rank's figures from its pod's /metrics, refreshed"),
    "wait": ("ddp_operator.commands.wait", "wait for a DDPJob to reach a phase; exit 0 when it does"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpjob",
        description="Run PyTorch DDP training as DDPJobs: on Kubernetes, or on this machine.",
    )
    parser.add_argument("--version", action="version", version=f"ddpjob {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # an extra that is not installed
            sub.set_defaults(_missing=f"`ddpjob {name}` is unavailable: {exc}")
            continue
        module.configure_parser(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:
        print(f"ddpjob: {missing}", file=sys.stderr)
        return 2
    result: int = args._module.main(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
