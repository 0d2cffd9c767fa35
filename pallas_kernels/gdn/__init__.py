"""Gated DeltaNet ops: gating, chunked prefill, recurrent decode/verify, commit."""

from pallas_kernels.gdn.chunk import chunk_gated_delta_rule
from pallas_kernels.gdn.commit import commit_states
from pallas_kernels.gdn.fused_recurrent import (
    InputConv,
    OutputNorm,
    fused_gating_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    packed_gating_recurrent_gated_delta_rule,
    split_ba,
    split_qkv,
    stack_gate_params,
    verify_gated_delta_rule,
)
from pallas_kernels.gdn.gating import gdn_gating

__all__ = [
    "InputConv",
    "OutputNorm",
    "chunk_gated_delta_rule",
    "commit_states",
    "fused_gating_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gdn_gating",
    "packed_gating_recurrent_gated_delta_rule",
    "split_ba",
    "split_qkv",
    "stack_gate_params",
    "verify_gated_delta_rule",
]
