"""Mixture-of-experts ops: the grouped matmul over tokens sorted by expert, the product of
each row with its own experts read by id (a few tokens a step), a few tokens' routing
(their top-k experts and the softmax over them), and the combine of a by-id block's output
into the residual stream with the next norm's square sums."""

from pallas_kernels.moe.combine import combine_pairs, combine_pairs_reference
from pallas_kernels.moe.combine import unsupported_reason as combine_pairs_unsupported_reason
from pallas_kernels.moe.expert_matmul import (
    PAIRED_UNITS,
    PairTiles,
    expert_hidden,
    expert_hidden_reference,
    expert_matmul,
    expert_matmul_reference,
    expert_mlp,
    pair_halves,
    paired_swiglu,
    unpair_halves,
)
from pallas_kernels.moe.expert_matmul import (
    hidden_unsupported_reason as expert_hidden_unsupported_reason,
)
from pallas_kernels.moe.expert_matmul import mlp_unsupported_reason as expert_mlp_unsupported_reason
from pallas_kernels.moe.expert_matmul import unsupported_reason as expert_matmul_unsupported_reason
from pallas_kernels.moe.grouped_matmul import grouped_matmul, unsupported_reason
from pallas_kernels.moe.routing import ranked_top_k, softmax_of_exps, top_k_exps, top_k_softmax

__all__ = [
    "PAIRED_UNITS",
    "PairTiles",
    "combine_pairs",
    "combine_pairs_reference",
    "combine_pairs_unsupported_reason",
    "expert_hidden",
    "expert_hidden_reference",
    "expert_hidden_unsupported_reason",
    "expert_matmul",
    "expert_matmul_reference",
    "expert_matmul_unsupported_reason",
    "expert_mlp",
    "expert_mlp_unsupported_reason",
    "grouped_matmul",
    "pair_halves",
    "paired_swiglu",
    "ranked_top_k",
    "softmax_of_exps",
    "top_k_exps",
    "top_k_softmax",
    "unpair_halves",
    "unsupported_reason",
]
