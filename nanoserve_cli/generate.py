"""`nanoserve generate`: one completion streamed to the terminal."""
import argparse
import sys

import grpc

from nanoserve.client import Client
from nanoserve.v1 import llm_pb2


def stream_to_terminal(args: argparse.Namespace) -> int:
    """Prints the text as it streams, then the usage line on stderr; 1 on a gRPC error."""
    with Client(args.address) as client:
        try:
            for msg in client.stream(args.prompt, max_tokens=args.max_tokens,
                                     temperature=args.temperature, ignore_eos=args.ignore_eos,
                                     seed=None if args.seed < 0 else args.seed):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    reason = llm_pb2.FinishReason.Name(msg.finish_reason)
                    u = msg.usage
                    print(f"\n[{reason}: {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} "
                          f"cached), {u.completion_tokens} generated]", file=sys.stderr)
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0
