"""`python -m worker_svc`: one worker rank, configured by the `worker` flags of the contract's table
(`nanoserve worker` runs this)."""
import sys

from nanoserve.flags import parse
from worker_svc.config import WorkerConfig
from worker_svc.server import serve_worker


def main(argv: list[str] | None = None) -> int:
    args = parse("worker", argv, prog="python -m worker_svc")
    return serve_worker(WorkerConfig.from_flags(args), args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
