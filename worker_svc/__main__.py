"""`python -m worker_svc`: one worker rank, configured by the `worker` flags of the contract's table
(`nanoserve worker` runs this)."""
import logging
import sys

from nanoserve.flags import parse
from nanoserve.lifeline import follow_launcher
from nanoserve.listen import ListenError, check_port_free
from nanoserve.logs import configure_logging
from nanoserve.tls import tls_files


def main(argv: list[str] | None = None) -> int:
    args = parse("worker", argv, prog="python -m worker_svc")
    follow_launcher()
    configure_logging(args.log_level, args.log_format)
    try:  # before torch is imported, which takes seconds: a busy port fails at once
        check_port_free(args.host, args.port, f"worker rank {args.rank}'s --port")
    except ListenError as err:
        logging.getLogger("nanoserve.worker").error("cannot start: %s", err)
        return 1
    from worker_svc.config import WorkerConfig
    from worker_svc.server import serve_worker

    return serve_worker(WorkerConfig.from_flags(args), args.host, args.port, tls_files(args), args.worker_token,
                        args.shutdown_timeout)


if __name__ == "__main__":
    sys.exit(main())
