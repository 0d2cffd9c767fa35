"""Suite-wide setup that must run before any test module initialises a JAX backend.

The Mosaic GPU interpreter runs each warpgroup of a CTA as a host thread whose callbacks
(barrier waits among them) execute on the XLA CPU client's worker pool. That pool's size is
read from ``NPROC`` (default: the CPU count) when the CPU client is created. A warp-specialised
kernel (``pallas_kernels/gdn/_chunk_state.py``: three warpgroups, each blocked in barrier
waits while another must run) deadlocks the interpreter on a 2-CPU machine with the default.
This file is imported before every test module of the suite (also by each xdist worker), so
setting the variable here precedes the first backend in any order of collection.
"""

from __future__ import annotations

import os

os.environ.setdefault("NPROC", "16")
