"""worker_svc/distributed.py's group-wide choice, over two gloo ranks in processes of their own: a
choice that decides which collectives a rank runs next (take the offered KV pool, or run the
profiling forward) is yes only where every rank says yes, so no rank waits in a collective the
other never joins."""
import torch.multiprocessing as mp

from tests.services.processes import free_port


def _rank(rank: int, port: int, votes: list[list[bool]], results) -> None:
    import torch
    import torch.distributed as dist

    from worker_svc.distributed import all_ranks_agree
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results[rank] = [all_ranks_agree(vote[rank], torch.device("cpu")) for vote in votes]
    dist.destroy_process_group()


def test_ranks_take_a_choice_together():
    votes = [[True, True], [True, False], [False, True], [False, False]]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), votes, results), nprocs=2)
        assert results[0] == results[1] == [True, False, False, False]
