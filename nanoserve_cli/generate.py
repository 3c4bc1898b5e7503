"""`nanoserve generate`: one completion streamed to the terminal."""
import argparse
import sys

import grpc

from nanoserve.flags import defaults
from nanoserve.v1 import llm_pb2
from nanoserve_cli.client_commands import open_client, rpc_error_line

SERVER_DEFAULT = defaults("generate")["temperature"]  # send none: the server applies the model's default


def stream_to_terminal(args: argparse.Namespace) -> int:
    """Prints the text as it streams, then the usage line on stderr; 1 on a gRPC error."""
    temperature = None if args.temperature == SERVER_DEFAULT else args.temperature
    with open_client(args) as client:
        try:
            for msg in client.stream(args.prompt, max_tokens=args.max_tokens,
                                     temperature=temperature, ignore_eos=args.ignore_eos,
                                     seed=None if args.seed < 0 else args.seed):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    reason = llm_pb2.FinishReason.Name(msg.finish_reason)
                    u = msg.usage
                    print(f"\n[{reason}: {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} "
                          f"cached), {u.completion_tokens} generated]", file=sys.stderr)
        except grpc.RpcError as err:
            print("\n" + rpc_error_line(err, args), file=sys.stderr)
            return 1
    return 0
