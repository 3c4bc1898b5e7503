"""`nanoserve` command line: worker, scheduler, gateway, up (local launcher), generate and chat.

Flags come from the contract's table (nanoserve.flags), each with its NANOSERVE_<FLAG> fallback.
`worker`, `scheduler` and `gateway` check their flags here, then replace this process with the
service (`python -m worker_svc ...`), which parses the same flags from the same table: the CLI
imports no service, and signals and the exit status are the service's own.
"""
import argparse
import os
import sys

from nanoserve import flags
from nanoserve_cli.generate import chat_to_terminal, stream_to_terminal
from nanoserve_cli.launcher import SERVICE_MODULES, run_local

COMMANDS = (*SERVICE_MODULES, "up", "generate", "chat")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="gRPC LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        flags.add_flags(sub.add_parser(command, help=flags.COMMANDS[command],
                                       description=flags.COMMANDS[command]), command)
    sub.choices["generate"].add_argument("prompt", help="prompt text")
    sub.choices["chat"].add_argument("message", help="the user's message")
    return parser


def exec_service(module: str, argv: list[str]) -> None:
    """Becomes `python -m module argv...` (same interpreter, same environment); never returns."""
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command in SERVICE_MODULES:
        exec_service(SERVICE_MODULES[args.command], argv[argv.index(args.command) + 1:])
    if args.command == "up":
        return run_local(args)
    if args.command == "chat":
        return chat_to_terminal(args)
    return stream_to_terminal(args)


if __name__ == "__main__":
    sys.exit(main())
