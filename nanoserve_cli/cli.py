"""`nanoserve` command line: worker, scheduler, gateway, up (local launcher), and the clients generate,
chat, info, stats and tokenize.

Flags come from the contract's table (nanoserve.flags), each with its NANOSERVE_<FLAG> fallback.
`worker`, `scheduler` and `gateway` check their flags here, then replace this process with the
service (`python -m worker_svc ...`), which parses the same flags from the same table: the CLI
imports no service, and signals and the exit status are the service's own. Whatever goes wrong on
the client side ends with one line on stderr, never a traceback: 1 for a failure, 130 for Ctrl-C.
"""
import argparse
import importlib.util
import os
import sys

from nanoserve import __version__, flags
from nanoserve.tls import TLSConfigError
from nanoserve_cli.client_commands import QUERIES, run_query
from nanoserve_cli.generate import chat_to_terminal, stream_to_terminal
from nanoserve_cli.launcher import run_local
from nanoserve_cli.replica import SERVICE_MODULES

COMMANDS = (*SERVICE_MODULES, "up", "generate", "chat", *QUERIES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="gRPC LLM server")
    parser.add_argument("--version", action="version", version=f"nanoserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        flags.add_flags(sub.add_parser(command, help=flags.COMMANDS[command],
                                       description=flags.COMMANDS[command]), command)
    sub.choices["generate"].add_argument("prompt", help="prompt text")
    sub.choices["chat"].add_argument("message", help="the user's message")
    sub.choices["tokenize"].add_argument("text", help="text to tokenize")
    return parser


def exec_service(module: str, argv: list[str]) -> None:
    """Becomes `python -m module argv...` (same interpreter, same environment); never returns."""
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command in ("worker", "up") and importlib.util.find_spec("torch") is None:
        print(f"nanoserve {args.command}: a worker needs torch, which is not installed here: "
              "pip install 'nanoserve[worker]' (or the torch build for your CUDA first)", file=sys.stderr)
        return 1
    if args.command in SERVICE_MODULES:
        exec_service(SERVICE_MODULES[args.command], argv[argv.index(args.command) + 1:])
    if args.command == "up":
        return run_local(args)
    try:
        if args.command == "generate":
            return stream_to_terminal(args)
        return chat_to_terminal(args) if args.command == "chat" else run_query(args)
    except TLSConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `nanoserve stats | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
