"""`nanoserve generate` and `nanoserve chat`: one completion streamed to the terminal."""
import argparse
import json
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import grpc

from nanoserve.v1 import llm_pb2
from nanoserve_cli.client_commands import open_client, rpc_error_line

# Flag value -> what it means: "send none" (the server's default, possibly the model's own), or off.
_SERVER_DEFAULT = {"temperature": -1.0, "top_p": -1.0, "top_k": 0}
_OFF = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}


def sampling_fields(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the flags set: a flag at its server-default or off value sends nothing."""
    fields = dict(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=None if args.seed < 0 else args.seed,
                  stop=args.stop, logprobs=None if args.logprobs < 0 else args.logprobs)
    unsent = {**_SERVER_DEFAULT, **_OFF}
    fields.update({name: getattr(args, name) for name, value in unsent.items() if getattr(args, name) != value})
    return fields


def stream_to_terminal(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        return _print_stream(client.stream(args.prompt, **sampling_fields(args)), args)


def chat_to_terminal(args: argparse.Namespace) -> int:
    try:
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    except json.JSONDecodeError as err:
        print(f"error: --chat-template-kwargs is not JSON: {err}", file=sys.stderr)
        return 2
    if not isinstance(kwargs, dict):
        print("error: --chat-template-kwargs must be a JSON object", file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    with open_client(args) as client:
        return _print_stream(client.chat_stream(messages, chat_template_kwargs=kwargs, **sampling_fields(args)),
                             args)


@contextmanager
def _ctrl_c_cancels(call):
    """Ctrl-C cancels `call` (a gRPC stream, or failover's ResumingStream), and KeyboardInterrupt comes
    once gRPC has ended the call. Raised in the middle of gRPC's wait for the next message, it could
    leave the wait's lock released under it; the interpreter exiting while gRPC's thread still handles
    the call can hang it (a lock that thread held) or abort it (gRPC's C core)."""
    interrupted, ended = False, threading.Event()

    def cancel(signum, frame) -> None:
        nonlocal interrupted
        interrupted = True
        if not call.add_callback(ended.set):  # the call had already ended
            ended.set()
        call.cancel()

    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:  # else Ctrl-C stays as it was (e.g. ignored in a background job)
        signal.signal(signal.SIGINT, cancel)
    try:
        yield
    except grpc.RpcError:  # CANCELLED, or whatever else ended the stream as it was being cancelled
        if not interrupted:
            raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        ended.wait()  # set by gRPC's thread once through with the call; a second Ctrl-C ends the wait
        raise KeyboardInterrupt


def _print_stream(messages: Iterator[llm_pb2.GenerateResponse], args: argparse.Namespace) -> int:
    """Prints the text as it streams (or, with --logprobs, a line per token), then the finish line
    on stderr; 1 on a gRPC error."""
    try:
        with _ctrl_c_cancels(messages):
            for msg in messages:
                if args.logprobs >= 0:
                    for entry in msg.logprobs:
                        alternatives = "  ".join(f"{top.text!r} {top.logprob:.3f}" for top in entry.top)
                        print(f"{entry.token.text!r} {entry.token.logprob:.3f} (rank {entry.token.rank})  "
                              f"[{alternatives}]")
                else:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                if msg.finish_reason:
                    _print_finish(msg)
    except grpc.RpcError as err:
        print("\n" + rpc_error_line(err, args), file=sys.stderr)
        return 1
    return 0


def _print_finish(msg: llm_pb2.GenerateResponse) -> None:
    reason = llm_pb2.FinishReason.Name(msg.finish_reason)
    kind = msg.WhichOneof("stop_reason")
    stopped_by = f" at {getattr(msg, kind)!r}" if kind else ""
    u = msg.usage
    print(f"\n[{reason}{stopped_by}: {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} cached), "
          f"{u.completion_tokens} generated]", file=sys.stderr)
