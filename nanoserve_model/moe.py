"""The sparse MLP block of a mixture-of-experts layer: a router picks each token's top-k experts, each
a SiLU-gated MLP of `moe_intermediate_size`, and their outputs are summed with the routing weights.

Checkpoints store every expert's projections separately (`experts.{e}.gate_proj.weight`, ...); here
they are stacked into two tensors per layer, [experts, 2 d, hidden] (each expert's gate rows on its
up rows, as a dense MLP packs them) and [experts, hidden, d], which the fused kernels read. Tensor
parallelism splits every expert's intermediate dimension as it splits a dense MLP's (gate/up by
rows, down by columns), so each rank runs every expert on every routed token and one all-reduce per
layer sums the partial outputs. The router is small and kept whole on every rank, so all ranks
route alike, and stays in the model dtype (FP8 checkpoints list it in modules_to_not_convert).

From an FP8 checkpoint (nanoserve_model/fp8_weights.py) the stacked experts hold e4m3 values with each
expert's block scales stacked beside them, on CUDA; on CPU their dequantized values."""
import torch
from torch import nn

from nanoserve_kernels.moe_reference import BlockScales, dequantize_experts, experts_reference, route
from nanoserve_model.fp8_weights import Fp8Source, copy_weight, new_weight, unquantize_storage
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
    """Every expert's weights, this rank's share of each: gate_up_proj [E, 2 d, hidden], down_proj [E, hidden, d].
    Built under fp8_storage they are e4m3 with float32 scales per block of each expert's matrices
    (`gate_up_proj_scale` [E, 2 d / bn, hidden / bk], `down_proj_scale` [E, hidden / bn, d / bk]), as the
    checkpoint's per-expert scale tensors stack; elsewhere the model dtype (scales None)."""

    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        self.num_experts, self.width, self.hidden_size = moe.num_experts, moe.moe_intermediate_size, hidden_size
        experts, width = self.num_experts, self.width
        self.rows = divide(width, tp_world_size(), "expert intermediate size (moe_intermediate_size)")
        self.start = tp_rank() * self.rows
        self.gate_up_proj = stack_checkpoint_tensors(set_weight_loader(
            new_weight(self, 2 * self.rows, hidden_size, "gate_up_proj", experts), self.load_gate_up,
            {(e, part): (width, hidden_size) for e in range(experts) for part in (GATE, UP)}),
            {f"{e}.{name}.weight": (e, part) for e in range(experts)
             for name, part in (("gate_proj", GATE), ("up_proj", UP))})
        self.down_proj = stack_checkpoint_tensors(set_weight_loader(
            new_weight(self, hidden_size, self.rows, "down_proj", experts), self.load_down,
            {e: (hidden_size, width) for e in range(experts)}),
            {f"{e}.down_proj.weight": e for e in range(experts)})

    def load_gate_up(self, param: nn.Parameter, loaded: CheckpointTensor | Fp8Source, shard_id: tuple[int, int]
                     ) -> None:
        expert, part = shard_id
        copy_weight(self, 0, part * self.rows, loaded, self.start, self.rows, "gate_up_proj", expert)

    def load_down(self, param: nn.Parameter, loaded: CheckpointTensor | Fp8Source, expert: int) -> None:
        copy_weight(self, 1, 0, loaded, self.start, self.rows, "down_proj", expert)

    def matrices(self) -> dict[str, tuple[int, tuple[int, int], bool]]:
        """Each expert's checkpoint matrices (relative names) -> (the dimension split over the ranks,
        the full shape, whether another matrix is packed right after it): what Fp8Plan checks and scales."""
        gate_up, down = (self.width, self.hidden_size), (self.hidden_size, self.width)
        return {f"{e}.{name}": matrix for e in range(self.num_experts)
                for name, matrix in (("gate_proj", (0, gate_up, True)), ("up_proj", (0, gate_up, False)),
                                     ("down_proj", (1, down, False)))}

    def unquantize_storage(self, dtype: torch.dtype) -> None:
        """Built under fp8_storage but left unquantized by the checkpoint: `dtype` after all."""
        for name in ("gate_up_proj", "down_proj"):
            unquantize_storage(self, dtype, name)

    def block_scales(self, name: str) -> BlockScales | None:
        """The scales of the e4m3 weight `name` (gate_up_proj, down_proj) and their block; None unquantized."""
        scale = getattr(self, f"{name}_scale")
        return None if scale is None else BlockScales(scale, getattr(self, f"{name}_block"))

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as the per-expert reference multiplies them: the held weights, or e4m3 ones
        dequantized to `dtype`."""
        return tuple(weight if scales is None else dequantize_experts(weight, scales, dtype)
                     for weight, scales in ((self.gate_up_proj, self.block_scales("gate_up_proj")),
                                            (self.down_proj, self.block_scales("down_proj"))))


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
            experts = self.experts
            out = fused_moe(hidden, experts.gate_up_proj, experts.down_proj, router_logits, self.top_k,
                            self.renormalize, gate_up_scales=experts.block_scales("gate_up_proj"),
                            down_scales=experts.block_scales("down_proj"))
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize)
            out = experts_reference(hidden, *self.experts.dequantized(hidden.dtype), weights, ids)
        return all_reduce(out)

    def after_norm(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block of norm(hidden + residual), hidden + residual), as GatedMLP.after_norm."""
        hidden, residual = norm(hidden, residual)
        return self(hidden), residual
