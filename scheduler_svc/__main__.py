"""`python -m scheduler_svc`: the scheduler, configured by the `scheduler` flags of the contract's
table (`nanoserve scheduler` runs this)."""
import sys

from nanoserve.flags import parse
from scheduler_svc.server import serve_scheduler


def main(argv: list[str] | None = None) -> int:
    return serve_scheduler(parse("scheduler", argv, prog="python -m scheduler_svc"))


if __name__ == "__main__":
    sys.exit(main())
