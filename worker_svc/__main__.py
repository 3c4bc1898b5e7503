"""`python -m worker_svc`: one worker rank, configured by the `worker` flags of the contract's table
(`nanoserve worker` runs this); started as a standby (nanoserve.standby), it waits for the launcher's
word first."""
import logging
import sys

from nanoserve.flags import parse
from nanoserve.lifeline import follow_launcher
from nanoserve.listen import ListenError, check_port_free
from nanoserve.logs import configure_logging
from nanoserve.tls import tls_files
from worker_svc.startup_phases import StartupPhases, process_started_at


def main(argv: list[str] | None = None) -> int:
    phases = StartupPhases(process_started_at())
    args = parse("worker", argv, prog="python -m worker_svc")
    follow_launcher()
    configure_logging(args.log_level, args.log_format)
    from worker_svc.config import WorkerConfig
    from worker_svc.standby import stand_by, started_as_standby

    config = WorkerConfig.from_flags(args)
    if started_as_standby():
        if not stand_by(config):
            return 0  # not needed after all
        phases = StartupPhases()  # the restart starts now: the process and its imports were ready
    phases.end("process start")
    try:  # before torch is imported, which takes seconds: a busy port fails at once
        check_port_free(args.host, args.port, f"worker rank {args.rank}'s --port")
    except ListenError as err:
        logging.getLogger("nanoserve.worker").error("cannot start: %s", err)
        return 1
    from worker_svc.server import serve_worker

    return serve_worker(config, args.host, args.port, tls_files(args), args.worker_token, args.shutdown_timeout,
                        phases)


if __name__ == "__main__":
    sys.exit(main())
