"""`python -m gateway_svc`: the OpenAI HTTP API in front of a scheduler, configured by the `gateway`
flags of the contract's table (`nanoserve gateway` runs this); serve.py runs its processes."""
import logging
import sys

from gateway_svc.serve import log_format, serve
from nanoserve.flags import parse
from nanoserve.lifeline import follow_launcher
from nanoserve.listen import ListenError, check_port_free


def main(argv: list[str] | None = None) -> int:
    args = parse("gateway", argv, prog="python -m gateway_svc")
    follow_launcher()
    logging.basicConfig(level=args.log_level.upper(), format=log_format(args.api_server_count))
    try:  # before any process starts: one line, not one per process
        check_port_free(args.host, args.port, "the gateway's --port")
    except ListenError as err:
        logging.getLogger("nanoserve.gateway").error("cannot start: %s", err)
        return 1
    serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
