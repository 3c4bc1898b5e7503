"""`nanoserve generate` and `nanoserve chat`: one completion streamed to the terminal."""
import argparse
import json
import sys
from typing import Iterator

import grpc

from nanoserve.client import Client
from nanoserve.v1 import llm_pb2


def sampling_fields(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the flags set; flags left at their neutral value send nothing."""
    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                  seed=None if args.seed < 0 else args.seed, stop=args.stop,
                  logprobs=None if args.logprobs < 0 else args.logprobs)
    neutral = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0, min_tokens=0)
    fields.update({name: getattr(args, name) for name, off in neutral.items() if getattr(args, name) != off})
    return fields


def stream_to_terminal(args: argparse.Namespace) -> int:
    with Client(args.address) as client:
        return _print_stream(client.stream(args.prompt, **sampling_fields(args)), args.logprobs >= 0)


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
    with Client(args.address) as client:
        return _print_stream(client.chat_stream(messages, chat_template_kwargs=kwargs, **sampling_fields(args)),
                             args.logprobs >= 0)


def _print_stream(messages: Iterator[llm_pb2.GenerateResponse], logprobs: bool) -> int:
    """Prints the text as it streams (or, with logprobs, a line per token), then the finish line
    on stderr; 1 on a gRPC error."""
    try:
        for msg in messages:
            if logprobs:
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
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0


def _print_finish(msg: llm_pb2.GenerateResponse) -> None:
    reason = llm_pb2.FinishReason.Name(msg.finish_reason)
    kind = msg.WhichOneof("stop_reason")
    stopped_by = f" at {getattr(msg, kind)!r}" if kind else ""
    u = msg.usage
    print(f"\n[{reason}{stopped_by}: {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} cached), "
          f"{u.completion_tokens} generated]", file=sys.stderr)
