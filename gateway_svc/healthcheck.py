"""Container health probe of the gateway: exit status 0 only when its /health answers 200, i.e. the
gateway is up and its scheduler SERVING.

    python -m gateway_svc.healthcheck [the gateway's own flags: --port 8000 ...]

It takes the gateway's flags (and their NANOSERVE_* fallbacks), so it asks the port the gateway
listens on; a gateway on every address (0.0.0.0, ::) is asked on loopback. Prints one line saying
why the gateway is not healthy. Standard library only: it runs in a few milliseconds.
"""
import json
import sys
import urllib.error
import urllib.request

from nanoserve.flags import parse

_EVERY_ADDRESS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}
TIMEOUT_SECONDS = 5.0


def health_url(host: str, port: int) -> str:
    host = _EVERY_ADDRESS.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{host}:{port}/health"


def main(argv: list[str] | None = None) -> int:
    args = parse("gateway", argv, prog="python -m gateway_svc.healthcheck")
    url = health_url(args.host, args.port)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS):
            pass
    except urllib.error.HTTPError as err:  # the gateway answers: its error body says why
        try:
            reason = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = err.reason
        print(f"unhealthy: {url} answered {err.code}: {reason}", file=sys.stderr)
        return 1
    except OSError as err:  # refused, unreachable, timed out
        print(f"unhealthy: {url} did not answer: {getattr(err, 'reason', err)}", file=sys.stderr)
        return 1
    print(f"healthy: {url} answered 200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
