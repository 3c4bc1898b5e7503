"""The sparse MLP block of a mixture-of-experts layer: a router picks each token's top-k experts, each
a SiLU-gated MLP of `moe_intermediate_size`, and their outputs are summed with the routing weights.

Checkpoints store every expert's projections separately (`experts.{e}.gate_proj.weight`, ...); here
they are stacked into two tensors per layer, [experts, 2 d, hidden] (each expert's gate rows on its
up rows, as a dense MLP packs them) and [experts, hidden, d], which the fused kernels read. Tensor
parallelism splits every expert's intermediate dimension as it splits a dense MLP's (gate/up by
rows, down by columns), so each rank runs every expert on every routed token and one all-reduce per
layer sums the partial outputs. The router is small and kept whole on every rank, so all ranks
route alike."""
import torch
from torch import nn

from nanoserve_kernels.moe_reference import experts_reference, route
from nanoserve_model.linear import linear
from nanoserve_model.moe_config import MoeConfig
from nanoserve_model.norm import RMSNorm
from nanoserve_model.parallel import (CheckpointTensor, all_reduce, divide, set_weight_loader, stack_checkpoint_tensors,
                                      tp_rank, tp_world_size)

GATE, UP = 0, 1  # a gate/up checkpoint tensor's place in the packed expert


class Router(nn.Module):
    """The `mlp.gate` linear layer: one logit per expert, whole on every rank."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = set_weight_loader(nn.Parameter(torch.empty(num_experts, hidden_size)), self.load_whole,
                                        {None: (num_experts, hidden_size)})

    @staticmethod
    def load_whole(param: nn.Parameter, loaded: CheckpointTensor) -> None:
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)


class Experts(nn.Module):
    """Every expert's weights, this rank's share of each: gate_up_proj [E, 2 d, hidden], down_proj [E, hidden, d]."""

    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        experts, width = moe.num_experts, moe.moe_intermediate_size
        self.rows = divide(width, tp_world_size(), "expert intermediate size (moe_intermediate_size)")
        self.start = tp_rank() * self.rows
        self.gate_up_proj = stack_checkpoint_tensors(set_weight_loader(
            nn.Parameter(torch.empty(experts, 2 * self.rows, hidden_size)), self.load_gate_up,
            {(e, part): (width, hidden_size) for e in range(experts) for part in (GATE, UP)}),
            {f"{e}.{name}.weight": (e, part) for e in range(experts)
             for name, part in (("gate_proj", GATE), ("up_proj", UP))})
        self.down_proj = stack_checkpoint_tensors(set_weight_loader(
            nn.Parameter(torch.empty(experts, hidden_size, self.rows)), self.load_down,
            {e: (hidden_size, width) for e in range(experts)}),
            {f"{e}.down_proj.weight": e for e in range(experts)})

    def load_gate_up(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        param.data[expert].narrow(0, part * self.rows, self.rows).copy_(loaded.narrow(0, self.start, self.rows))

    def load_down(self, param: nn.Parameter, loaded: CheckpointTensor, expert: int) -> None:
        param.data[expert].copy_(loaded.narrow(1, self.start, self.rows))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        self.top_k, self.renormalize = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = Experts(hidden_size, moe)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> the weighted sum of each token's top-k experts, summed over the ranks.
        On CUDA the fused Triton kernels; on CPU the plain per-expert loop."""
        router_logits = self.gate(hidden)
        if hidden.is_cuda:
            from nanoserve_kernels.fused_moe import fused_moe  # Triton is a GPU requirement only
            out = fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj, router_logits,
                            self.top_k, self.renormalize)
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize)
            out = experts_reference(hidden, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return all_reduce(out)

    def after_norm(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block of norm(hidden + residual), hidden + residual), as GatedMLP.after_norm."""
        hidden, residual = norm(hidden, residual)
        return self(hidden), residual
