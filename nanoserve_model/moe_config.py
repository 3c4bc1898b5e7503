"""What a mixture-of-experts model adds to its config: how many experts, how many a token is routed
to, their width, and which decoder layers have them (the others keep the dense MLP). The family reads
it from config.json (nanoserve_model.qwen3_moe)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int        # top-k: experts each token is routed to
    moe_intermediate_size: int      # each expert's gate/up width
    norm_topk_prob: bool = False    # renormalise the top-k softmax weights to sum to 1
    decoder_sparse_step: int = 1    # layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not one of these

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (else it has the dense MLP of intermediate_size)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
