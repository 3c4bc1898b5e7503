"""`python -m scheduler_svc`: the scheduler, configured by the `scheduler` flags of the contract's
table (`nanoserve scheduler` runs this)."""
import sys

from nanoserve.flags import parse
from nanoserve.lifeline import follow_launcher
from nanoserve.logs import configure_logging
from scheduler_svc.server import serve_scheduler


def main(argv: list[str] | None = None) -> int:
    args = parse("scheduler", argv, prog="python -m scheduler_svc")
    follow_launcher()
    configure_logging(args.log_level, args.log_format)
    return serve_scheduler(args)


if __name__ == "__main__":
    sys.exit(main())
