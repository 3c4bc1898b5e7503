"""Every nanoserve flag, declared once: default, type, choices, help, environment variable and the
commands that take it. The parsers of the CLI, the services and the health probe are built from
this table; `nanoserve up` forwards to each child the flags both commands share; the services'
config defaults and the README's flag table come from it:

    python -m nanoserve.flags --markdown

A flag's type is its default's type (a bool becomes --flag / --no-flag; a tuple, a flag given once
per value, whose environment variable holds one value). Every flag falls back to
the environment variable NANOSERVE_<FLAG> (NANOSERVE_TENSOR_PARALLEL_SIZE for
--tensor-parallel-size), so containers can be configured either way. Commands that share a row
take the same flag with the same meaning; a flag spelled alike but meaning something else in
another command has a row of its own.
"""
import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from nanoserve.wire import MAX_MESSAGE_BYTES

SCHEDULER_PORT = 50051  # the public nanoserve.v1.LLM API
WORKER_PORT = 50061     # the internal nanoserve.v1.Worker API
OPENAI_PORT = 8000      # the gateway's OpenAI-compatible HTTP API
WORKER_RESTART_BACKOFF_MAX = 30  # seconds: the longest pause before `up` restarts a failed worker group
WORKER_GROUP_STABLE_SECONDS = 10  # a group that served this long was not failing in a loop
GATEWAY_TITLE = "nanoserve OpenAI-compatible gateway"  # its /openapi.json title: how the CLI recognises it

COMMANDS = {  # command -> what it does (`python -m nanoserve.healthcheck` runs the last one)
    "worker": "serve one tensor-parallel rank of a model",
    "scheduler": "serve the public LLM API, driving the workers",
    "gateway": "serve the OpenAI-compatible HTTP API in front of a scheduler",
    "up": "start a scheduler and its workers (and a gateway) as local processes",
    "generate": "stream one completion to the terminal",
    "info": "print the served model's description (GetModelInfo) as JSON",
    "stats": "print the server's counters (GetStats) as JSON",
    "tokenize": "print the token ids of a text as a JSON list",
    "chat": "stream the model's answer to one chat message to the terminal",
    "healthcheck": "exit 0 only when the server reports SERVING",
}
ENGINE = ("worker", "scheduler", "up")  # limits a scheduler and its workers must agree on
WORKER = ("worker", "up")
SCHEDULER = ("scheduler", "up")
SERVERS = ("worker", "scheduler")                          # each serves its own gRPC port
LOGGING = ("worker", "scheduler", "up")
STOPPING = ("worker", "scheduler", "gateway", "up")  # servers that drain when stopped, and their launcher
CLIENTS = ("generate", "chat", "info", "stats", "tokenize", "healthcheck")  # ask a server over gRPC
GENERATE = ("generate", "chat")  # the client commands that generate
PORTS = (1, 65535)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KIND_NAMES = {int: "an integer", float: "a number"}


@dataclass(frozen=True)
class Flag:
    name: str                     # "--max-num-seqs"
    default: Any                  # its type is the flag's type
    help: str
    commands: tuple[str, ...]
    choices: tuple[str, ...] = ()
    limits: tuple[Any, Any] = ()  # (lowest, highest) a number may take

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "NANOSERVE_" + self.dest.upper()

    @property
    def kind(self) -> type:
        """The type of one value (str for a repeated flag)."""
        return str if self.repeated else type(self.default)

    @property
    def repeated(self) -> bool:
        return isinstance(self.default, tuple)

    def convert(self, raw: str) -> Any:
        """A command-line or environment string as this flag's value, or the error a person reads."""
        source = f"{self.name} / {self.env}"
        if self.kind is bool:
            if raw.strip().lower() not in _TRUE + _FALSE:
                raise argparse.ArgumentTypeError(f"{raw!r} is not a switch value ({source}: "
                                                 f"{', '.join(_TRUE)} or {', '.join(_FALSE)})")
            return raw.strip().lower() in _TRUE
        try:
            value = self.kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {_KIND_NAMES[self.kind]} ({source})") from None
        if self.choices and value not in self.choices:
            raise argparse.ArgumentTypeError(f"{raw!r} is not one of {', '.join(self.choices)} ({source})")
        if self.limits and not self.limits[0] <= value <= self.limits[1]:
            raise argparse.ArgumentTypeError(f"{raw!r} is outside {self.limits[0]}..{self.limits[1]} ({source})")
        return value

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this flag `value`."""
        if self.kind is bool:
            return [self.name if value else "--no-" + self.name.removeprefix("--")]
        if self.repeated:
            return [word for item in value for word in (self.name, str(item))]
        return [self.name, str(value)]


FLAGS = (
    # limits both sides use: the workers size CUDA graphs and buffers, the scheduler fills steps
    Flag("--max-num-seqs", 256, "most sequences running at once (CUDA graphs are captured up to it)", ENGINE),
    # 8,192: a step of that many prompt tokens keeps the GEMMs at full rate on the 0.6B-8B shapes, while a
    # mixed step holds up the decodes riding in it by one such prefill at most (vLLM's API-server default).
    Flag("--max-num-batched-tokens", 8192,
         "most tokens computed in one step (its token budget): the running sequences' decodes, then prompt "
         "chunks; workers size their step buffers for it", ENGINE),
    Flag("--max-model-len", 0, "prompt + output limit per sequence; 0 = the model's own", ENGINE),
    # a worker rank
    Flag("--model", "", "checkpoint directory (config.json, *.safetensors, tokenizer files) or Hugging Face Hub "
         "id (owner/name, fetched into the Hub cache); up without it serves the built-in tiny demo model", WORKER),
    Flag("--load-format", "auto", "where the weights come from: auto = safetensors, the checkpoint's files; dummy = "
         "random weights of config.json's shapes, to benchmark a shape without its weights", WORKER,
         ("auto", "safetensors", "dummy")),
    Flag("--revision", "", "branch, tag or commit of a Hub model (its tokenizer too); empty = main",
         ("worker", "scheduler", "up")),
    Flag("--download-dir", "", "where Hub models are downloaded; empty = the Hugging Face cache ($HF_HOME)",
         ("worker", "scheduler", "up")),
    Flag("--host", "127.0.0.1", "address to listen on; 0.0.0.0 = every interface (containers, other hosts)",
         SERVERS),
    Flag("--port", WORKER_PORT, "port the worker listens on", ("worker",), limits=PORTS),
    Flag("--rank", 0, "this worker's rank", ("worker",)),
    Flag("--dist-init-addr", "127.0.0.1:29500", "host:port where the ranks meet (rank 0's torch.distributed "
         "store)", ("worker",)),
    Flag("--advertise-host", "", "address the other ranks reach this rank at: its gloo sockets (the CPU "
         "collectives, the group's heartbeat) bind it, unlike --host, which only the gRPC port binds; empty = "
         "what this host's name resolves to (torch's default), or --dist-socket-ifname's interface", ("worker",)),
    Flag("--dist-socket-ifname", "", "network interface(s) of the ranks' torch.distributed traffic, comma-separated: "
         "sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; empty = torch's and NCCL's own choice (or those "
         "variables)", ("worker",)),
    Flag("--tensor-parallel-size", 1, "ranks the model is split across (one process each)", WORKER),
    Flag("--dtype", "auto", "weights and activations; auto = the checkpoint's own (config.json)", WORKER,
         ("auto", "float32", "bfloat16", "float16")),
    Flag("--device", "auto", "auto = cuda when available, else cpu", WORKER, ("auto", "cuda", "cpu")),
    Flag("--attention-backend", "auto", "auto = flash-attn if installed, else triton on GPU, torch on CPU",
         WORKER, ("auto", "flash-attn", "triton", "torch")),
    Flag("--kv-cache-dtype", "auto", "KV cache storage: auto = the model's dtype; fp8 = e4m3 with a scale per token "
         "and KV head, computed as it is stored: about twice the KV blocks (on GPU attention runs on the triton "
         "backend: flash-attn cannot read FP8)", WORKER, ("auto", "fp8")),
    Flag("--quantization", "auto", "weights: auto = as the checkpoint stores them (FP8 checkpoints: Qwen's block "
         "fp8 and compressed-tensors); fp8 = quantize an unquantized checkpoint's linear layers to e4m3 as they "
         "load, a scale per output channel (docs/fp8.md)", WORKER, ("auto", "fp8")),
    Flag("--block-size", 256, "tokens per KV block (flash-attn needs a multiple of 256)", WORKER),
    Flag("--gpu-memory-utilization", 0.9, "fraction of GPU memory the worker may use; the KV pool gets "
         "what the model and a warm-up leave", WORKER),
    Flag("--num-kv-blocks", 0, "force the KV block count; 0 = size from memory", WORKER),
    Flag("--cpu-kv-cache-gb", 1.0, "KV memory on CPU, in GiB", WORKER),
    Flag("--enforce-eager", False, "no CUDA graphs", WORKER),
    Flag("--seed", 0, "sampling seed of requests that bring none", WORKER),
    # the scheduler
    Flag("--workers", f"127.0.0.1:{WORKER_PORT}", "worker addresses (host:port), comma-separated, in rank order",
         ("scheduler",)),
    Flag("--port", SCHEDULER_PORT, "port the public LLM API listens on", SCHEDULER, limits=PORTS),
    Flag("--tokenizer", "", "directory with the tokenizer files (tokenizer.json, the chat template), or a Hub id; "
         "empty = the model the workers serve", SCHEDULER),
    Flag("--max-waiting", 4096, "queued requests before RESOURCE_EXHAUSTED", SCHEDULER),
    Flag("--enable-prefix-caching", True, "reuse KV blocks of shared prompt prefixes", SCHEDULER),
    Flag("--enable-chunked-prefill", True, "steps mix the running sequences' decodes with prompt chunks that fill "
         "the rest of the budget; off = a step either prefills whole prompts or decodes", SCHEDULER),
    Flag("--long-prefill-token-threshold", 0, "with chunked prefill, the most prompt tokens one request computes "
         "in a step (long prompts take more steps, others start sooner); 0 = the budget", SCHEDULER,
         limits=(0, 2**31 - 1)),
    Flag("--worker-connect-timeout", 300.0, "seconds to wait for every worker at start-up", SCHEDULER),
    Flag("--max-request-bytes", 8 << 20, "largest request accepted, in bytes (a text prompt is tokenized only "
         "below it); larger ones get INVALID_ARGUMENT", SCHEDULER, limits=(1, MAX_MESSAGE_BYTES)),
    Flag("--worker-restart-timeout", 300.0, "seconds to hold requests after a worker failure for the restarted "
         "worker group; past it they end UNAVAILABLE", SCHEDULER),
    Flag("--step-timeout", 300.0, "seconds a step may take before the ranks that have not answered count as "
         "hung: the scheduler stops waiting for them, a worker exits, up restarts them", ENGINE),
    # Kubernetes' default terminationGracePeriodSeconds is 30: a pod's grace period must exceed this.
    Flag("--shutdown-timeout", 25.0, "seconds a stopping server (SIGTERM, Ctrl-C) lets its requests in flight "
         "finish while it reports NOT_SERVING and refuses new ones (UNAVAILABLE / 503: the server is draining); "
         "then the rest end UNAVAILABLE (the server is shutting down) and it exits 0. A second signal stops at "
         "once. A worker waits this long (and a few seconds more) for its scheduler to let go", STOPPING,
         limits=(0.0, 24 * 3600.0)),
    Flag("--metrics-port", 0, "port serving Prometheus metrics at /metrics; 0 = off", SCHEDULER,
         limits=(0, PORTS[1])),
    Flag("--kv-events-config", "", "KV cache events for prefix-aware routers, as vLLM's JSON KVEventsConfig, e.g. "
         "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
         "(ZMQ PUB of msgpack batches, vLLM's wire format; needs pyzmq and msgpack); empty = off", SCHEDULER),
    Flag("--max-n", 16, "most completions one request may ask for (n)", SCHEDULER, limits=(1, 2**32 - 1)),
    Flag("--max-logprobs", 20, "most alternatives per token a request may ask for (logprobs, prompt_logprobs)",
         SCHEDULER, limits=(0, 2**32 - 1)),
    # security between the scheduler and its workers, and on the public API
    Flag("--worker-token", "", "shared secret the scheduler sends on every Worker RPC and the workers require; "
         "empty = none (`up` makes a random one for its own processes)", SERVERS),
    Flag("--tls-cert-file", "", "PEM certificate (chain) this server presents: serve TLS instead of plaintext",
         SERVERS),
    Flag("--tls-key-file", "", "PEM private key of --tls-cert-file", SERVERS),
    Flag("--tls-ca-file", "", "PEM CA certificates that client certificates must chain to: clients must present "
         "one (mutual TLS)", SERVERS),
    Flag("--worker-tls-ca-file", "", "PEM CA certificates the workers' certificates must chain to: reach the "
         "workers over TLS", ("scheduler",)),
    Flag("--worker-tls-cert-file", "", "PEM certificate the scheduler presents to workers that require one",
         ("scheduler",)),
    Flag("--worker-tls-key-file", "", "PEM private key of --worker-tls-cert-file", ("scheduler",)),
    # logs
    Flag("--log-level", "info", "least severe log lines written", LOGGING, ("debug", "info", "warning", "error")),
    Flag("--log-format", "text", "text lines, or one JSON object a line", LOGGING, ("text", "json")),
    # the OpenAI-compatible gateway
    Flag("--scheduler", f"127.0.0.1:{SCHEDULER_PORT}", "host:port of the scheduler's public gRPC API; more, "
         "comma-separated, are fallbacks (other replicas of the model): a stream broken by the first going away "
         "resumes on the next, and new requests it cannot take go there too", ("gateway",)),
    Flag("--host", "127.0.0.1", "address the HTTP API listens on", ("gateway",)),
    Flag("--port", OPENAI_PORT, "port the HTTP API listens on", ("gateway",), limits=PORTS),
    Flag("--served-model-name", "", "model id the HTTP API lists and answers to; empty = the model directory's "
         "name", ("gateway", "up")),
    Flag("--vllm-metric-names", False, "/metrics also serves the model-server gauges under vLLM's names "
         "(vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and its older "
         "vllm:gpu_cache_usage_perc, vllm:cache_config_info) for routers that hard-code them", ("gateway", "up")),
    Flag("--log-level", "info", "the gateway's log level (uvicorn's included)", ("gateway",),
         ("critical", "error", "warning", "info", "debug")),
    # One Python event loop turns every streamed message into an event: past ~15k streamed tokens/s it is
    # the ceiling. vLLM's default: a process costs ~100 MB and a core under load, and `up` shares the host.
    Flag("--api-server-count", 1, "gateway processes serving the HTTP port, each with its own event loop and "
         "scheduler connection (the port is bound once and shared; /metrics adds up theirs)", ("gateway", "up"),
         limits=(1, 64)),
    # the local launcher
    Flag("--host", "127.0.0.1", "address the scheduler listens on", ("up",)),
    Flag("--worker-base-port", WORKER_PORT, "rank r of replica d listens on this port + d x "
         "--tensor-parallel-size + r", ("up",), limits=PORTS),
    Flag("--max-worker-restarts", 10, "restarts of a failed worker group in a row (each after a longer pause, up "
         f"to {WORKER_RESTART_BACKOFF_MAX}s) before up gives up and stops; a group that has served for "
         f"{WORKER_GROUP_STABLE_SECONDS}s resets the count", ("up",),
         limits=(0, 2**31 - 1)),
    Flag("--standby-workers", False, "keep a standby process per worker rank, its imports done (about 1 GB of "
         "host memory each, no GPU memory), that takes the rank's place when its group is restarted: a restart "
         "skips process start and imports", ("up",)),
    Flag("--openai-port", 0, "also start the OpenAI-compatible gateway, listening on --host at this port; "
         "0 = no gateway. With --data-parallel-size > 1 the router listens here, replica d's gateway on "
         "127.0.0.1 at this port + 1 + d and the router's metrics at this port + 1 + the replica count",
         ("up",), limits=(0, PORTS[1])),
    Flag("--data-parallel-size", 1, "replicas, each a scheduler with its own worker group (and GPUs: replica d "
         "takes the d-th --tensor-parallel-size visible GPUs) behind the SMG router on --openai-port; replica "
         "d's scheduler listens on --port + d", ("up",), limits=(1, 1024)),
    Flag("--router-policy", "cache_aware", "how the SMG router (pip install 'nanoserve[router]') picks a replica "
         "for each request (its --policy)", ("up",),
         ("cache_aware", "round_robin", "power_of_two", "least_load", "prefix_hash", "random")),
    # clients
    Flag("--address", f"127.0.0.1:{SCHEDULER_PORT}", f"host[:port] of the server to ask (port {SCHEDULER_PORT} "
         "when none is given)", CLIENTS),
    Flag("--tls-ca-file", "", "PEM CA certificates the server's certificate must chain to: connect over TLS",
         CLIENTS),
    Flag("--tls-cert-file", "", "PEM client certificate, for a server that requires one (with --tls-ca-file)",
         CLIENTS),
    Flag("--tls-key-file", "", "PEM private key of --tls-cert-file", CLIENTS),
    Flag("--max-tokens", 64, "most tokens to generate", GENERATE, limits=(1, 2**32 - 1)),
    Flag("--temperature", -1.0, "0 = greedy; -1 = the server's default (1.0, or the model's own)", GENERATE),
    Flag("--seed", -1, "sampling seed; -1 = none", GENERATE, limits=(-1, 2**64 - 1)),
    Flag("--ignore-eos", False, "keep going past end-of-sequence", GENERATE),
    Flag("--top-p", -1.0, "draw from the most likely tokens covering this probability (1 = all); -1 = the "
         "server's default (1, or the model's own)", GENERATE),
    Flag("--top-k", 0, "draw from this many most likely tokens (-1 = all); 0 = the server's default (all, or "
         "the model's own)", GENERATE, limits=(-1, 2**31 - 1)),
    Flag("--min-p", 0.0, "drop tokens less likely than this times the most likely one", GENERATE),
    Flag("--repetition-penalty", 1.0, "penalize tokens of the prompt and output so far; 1 = off", GENERATE),
    Flag("--presence-penalty", 0.0, "subtract from tokens already in the output", GENERATE),
    Flag("--frequency-penalty", 0.0, "subtract per occurrence in the output", GENERATE),
    Flag("--min-tokens", 0, "tokens to generate before eos or a stop may end the output", GENERATE,
         limits=(0, 2**32 - 1)),
    Flag("--stop", (), "stop string, left out of the output (repeat the flag for several)", GENERATE),
    Flag("--logprobs", -1, "print each token's logprob and this many alternatives; -1 = none", GENERATE,
         limits=(-1, 2**32 - 1)),
    Flag("--system", "", "system message before the user's", ("chat",)),
    Flag("--chat-template-kwargs", "", "JSON object of extra chat template variables, e.g. "
         "'{\"enable_thinking\": false}'", ("chat",)),
    Flag("--service", "", "service name to ask about; empty = the whole server", ("healthcheck",)),
    Flag("--timeout", 2.0, "seconds to wait for the answer", ("healthcheck",)),
)


def flags_of(command: str) -> list[Flag]:
    return [flag for flag in FLAGS if command in flag.commands]


def shared(parent: str, child: str) -> list[Flag]:
    """The flags `parent` takes to hand on to `child`: rows both commands are listed in."""
    return [flag for flag in flags_of(parent) if child in flag.commands]


def defaults(command: str) -> dict[str, Any]:
    """dest -> the table's default, for every flag of `command` (the environment not applied)."""
    return {flag.dest: flag.default for flag in flags_of(command)}


class _Repeated(argparse.Action):
    """Each use adds a value; the first replaces the default (the environment's one value)."""

    def __call__(self, parser, namespace, values, option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if given is self.default else given), values])


class _Switch(argparse.Action):
    """--flag sets True, --no-flag False."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Adds `command`'s flags. A value from the environment stays a string until parsing, where
    argparse converts string defaults with `type`: a bad NANOSERVE_* value fails only the command
    that reads it, with the same message as the flag would."""
    for flag in flags_of(command):
        default = os.environ.get(flag.env, flag.default)
        shown = default if default not in ("", ()) else "none"
        help = f"{flag.help} (default: {shown}; env {flag.env})".replace("%", "%%")
        if flag.kind is bool:
            parser.add_argument(flag.name, "--no-" + flag.name.removeprefix("--"), action=_Switch,
                                default=default, type=flag.convert, help=help)
        elif flag.repeated:
            parser.add_argument(flag.name, action=_Repeated, default=[default] if flag.env in os.environ else [],
                                help=help)
        else:
            parser.add_argument(flag.name, default=default, type=flag.convert, help=help,
                                metavar="{" + ",".join(flag.choices) + "}" if flag.choices else None)


def parse(command: str, argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """`command`'s flags parsed from `argv` (default: sys.argv[1:]) and the environment."""
    parser = argparse.ArgumentParser(prog=prog, description=COMMANDS[command])
    add_flags(parser, command)
    return parser.parse_args(argv)


def to_argv(command: str, values: dict[str, Any]) -> list[str]:
    """The command line giving `command` these values (dest -> value), in table order."""
    known = {flag.dest for flag in flags_of(command)}
    if unknown := set(values) - known:
        raise KeyError(f"{command} takes no flag for {sorted(unknown)}")
    return [word for flag in flags_of(command) if flag.dest in values
            for word in flag.argv(values[flag.dest])]


def markdown() -> str:
    """The README's flag table."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("*", "\\*")

    def shown(flag: Flag) -> str:
        if flag.kind is bool:
            return "on" if flag.default else "off"
        return f"`{flag.default}`" if flag.default not in ("", ()) else "none"

    rows = ["| flag | commands | default | meaning | environment |", "| --- | --- | --- | --- | --- |"]
    for flag in FLAGS:
        choices = f"; one of {', '.join(f'`{choice}`' for choice in flag.choices)}" if flag.choices else ""
        rows.append(f"| `{flag.name}` | {', '.join(flag.commands)} | {shown(flag)} | {cell(flag.help)}{choices} "
                    f"| `{flag.env}` |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.flags", description="nanoserve's flag table")
    parser.add_argument("--markdown", action="store_true", required=True,
                        help="print the README's flag table")
    parser.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
