"""The `ddpjob` subcommands, one module each, named after its subcommand: `run` (a DDPJob as local
processes) and `operator` (the controller under kopf). cli.py dispatches to them.

Each exposes ``configure_parser(parser)`` and ``main(args) -> int``, and keeps heavy imports inside
``main``, so `ddpjob run --help` never pays for kopf nor `ddpjob operator` for torch."""
