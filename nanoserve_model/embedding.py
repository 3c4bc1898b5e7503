"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve_model.linear import linear
from nanoserve_model.parallel import CheckpointTensor, all_reduce, divide, set_weight_loader, tp_rank, tp_world_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.rank, self.world_size = tp_rank(), tp_world_size()
        rows = divide(vocab_size, self.world_size, "vocab size")
        self.vocab_start, self.vocab_end = self.rank * rows, (self.rank + 1) * rows
        self.weight = set_weight_loader(nn.Parameter(torch.empty(rows, hidden_size)), self.load_weight,
                                        {None: (vocab_size, hidden_size)})

    def load_weight(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(token_ids, self.weight)
        # Tokens outside this rank's slice look up row 0 and are zeroed; the all-reduce fills them in.
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        rows = F.embedding((token_ids - self.vocab_start) * mine, self.weight)
        return all_reduce(rows * mine.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] on rank 0 (each rank's vocab slice gathered there); None elsewhere."""
        logits = linear(hidden, self.weight)  # one row: the matrix-vector kernel
        if self.world_size == 1:
            return logits
        slices = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(logits, slices, dst=0)
        return torch.cat(slices, dim=-1) if self.rank == 0 else None
