"""Causal depthwise conv1d ops: varlen prefill, decode/verify update, commit."""

from pallas_kernels.conv1d.causal_conv1d import causal_conv1d
from pallas_kernels.conv1d.commit import commit_windows
from pallas_kernels.conv1d.update import causal_conv1d_update, causal_conv1d_verify

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_verify", "commit_windows"]
