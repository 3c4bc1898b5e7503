"""Container health probe over grpc.health.v1: exit status 0 only when the server says SERVING.

    python -m nanoserve.healthcheck [--address HOST:PORT] [--service NAME] [--timeout SECONDS]
                                    [--tls-ca-file CA.pem [--tls-cert-file C.pem --tls-key-file K.pem]]

Shipped in both images, so compose health checks need no downloaded binary. Prints one line
saying why the server is not healthy (unreachable, NOT_SERVING, unknown service, ...).
"""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanoserve.client import with_default_port
from nanoserve.flags import defaults, parse
from nanoserve.tls import TLSConfigError, TLSFiles, open_channel, tls_files

SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)
# The scheduler's health service for liveness probes: SERVING from the moment it listens until it
# exits, while "" (the whole server) is NOT_SERVING during start-up, a worker recovery or a drain.
LIVENESS = "liveness"


def serving_status(address: str, service: str = "", timeout: float = defaults("healthcheck")["timeout"],
                   tls: TLSFiles = TLSFiles()) -> str:
    """The status name `address` reports for `service` ("" = the whole server), e.g. "SERVING".

    Raises grpc.RpcError when the server cannot be asked (not listening, too slow, no such service).
    """
    with open_channel(with_default_port(address), tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    args = parse("healthcheck", argv, prog="python -m nanoserve.healthcheck")
    target = args.address + (f" ({args.service})" if args.service else "")
    try:
        status = serving_status(args.address, args.service, args.timeout, tls_files(args))
    except TLSConfigError as err:
        print(f"unhealthy: {err}", file=sys.stderr)
        return 1
    except grpc.RpcError as err:
        print(f"unhealthy: {target} did not answer: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if status != SERVING:
        print(f"unhealthy: {target} reports {status}", file=sys.stderr)
        return 1
    print(f"healthy: {target} reports {SERVING}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
