"""--kv-events-config: vLLM's KVEventsConfig, as JSON, with vLLM's keys and defaults, e.g.

    --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
                         "replay_endpoint": "tcp://*:5558", "topic": "kv@pod-1@qwen3"}'

Empty (the default) or enable_kv_cache_events false: no events, and nothing of them on the hot path.
"""
import json
from dataclasses import dataclass, fields

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"                 # "null" publishes nothing
    endpoint: str = "tcp://*:5557"         # PUB socket: bound when it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None     # ROUTER socket (always bound) resending buffered batches from a sequence
    buffer_steps: int = 10_000             # batches kept for replay
    hwm: int = 100_000                     # the PUB socket's high-water mark
    max_queue_size: int = 100_000          # batches waiting for the publishing thread before they are dropped
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


class KVEventsConfigError(ValueError):
    pass


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config in `text` (empty: off), or KVEventsConfigError saying what is wrong with it."""
    if not text.strip():
        return KVEventsConfig()
    try:
        given = json.loads(text)
    except json.JSONDecodeError as err:
        raise _error(f"is not JSON ({err})") from None
    if not isinstance(given, dict):
        raise _error("must be a JSON object")
    kinds = {field.name: field.type for field in fields(KVEventsConfig)}
    if unknown := sorted(set(given) - set(kinds)):
        raise _error(f"has unknown keys {unknown}; known: {', '.join(kinds)}")
    for key, value in given.items():
        if not _fits(value, kinds[key]):
            raise _error(f"{key}={json.dumps(value)} should be {getattr(kinds[key], '__name__', kinds[key])}")
    config = KVEventsConfig(**given)
    if config.publisher not in PUBLISHERS:
        raise _error(f"publisher={config.publisher!r} should be one of {', '.join(PUBLISHERS)}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, key) < 1:
            raise _error(f"{key} should be at least 1")
    return config


def _fits(value, kind: type) -> bool:
    """JSON's value of a field of type bool, int, str or str | None (a JSON true is no int here)."""
    if value is None:
        return kind == str | None
    return type(value) is (str if kind == str | None else kind)


def _error(problem: str) -> KVEventsConfigError:
    return KVEventsConfigError(f"--kv-events-config {problem}")
