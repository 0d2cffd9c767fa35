"""Kernel tests: enough XLA CPU worker threads for multi-warpgroup kernels in the interpreter.

The Mosaic GPU interpreter runs each warpgroup of a CTA as its own computation whose host
callbacks (barrier waits among them) execute on XLA's CPU worker pool, sized by the CPU
count. A warp-specialised kernel (``gdn/chunk_fused_mgpu.py``) has warpgroups blocked in
barrier waits while another must run: with 2 CPUs the pool runs out and the interpreter
deadlocks. ``NPROC`` sets that pool's size; it is read when the CPU client is created, so
it is set here, before any test module makes an array.
"""

from __future__ import annotations

import os

os.environ.setdefault("NPROC", "16")
