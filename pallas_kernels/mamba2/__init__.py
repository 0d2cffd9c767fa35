"""Mamba2 ops: SSD chunk scan (prefill), selective state update (decode/verify), commit."""

from pallas_kernels.mamba2.commit import commit_states
from pallas_kernels.mamba2.ssd_chunk_scan import ssd_chunk_scan
from pallas_kernels.mamba2.state_update import (
    selective_state_update,
    verify_selective_state_update,
)

__all__ = [
    "commit_states",
    "selective_state_update",
    "ssd_chunk_scan",
    "verify_selective_state_update",
]
