"""hybrid_jax: a functional serving backend for hybrid linear-attention models in JAX.

The front door: the engine and its configuration, sampling, the forward modes and their
errors, the metadata builder and the jitted steps. ``docs/DESIGN.md`` describes the
architecture (engine -> model -> layer -> backend -> kernel).
"""

from hybrid_jax.xla_flags import add_serving_flags

add_serving_flags()  # before anything starts a JAX backend

from hybrid_jax.engine.config import EngineConfig  # noqa: E402
from hybrid_jax.engine.engine import Engine  # noqa: E402
from hybrid_jax.engine.requests import Result, StepEvent  # noqa: E402
from hybrid_jax.engine.sampling import SamplingParams, SamplingParamsError  # noqa: E402
from hybrid_jax.engine.scheduler import FinishReason, RequestError  # noqa: E402
from hybrid_jax.engine.speculative import SpeculativeConfig  # noqa: E402
from hybrid_jax.engine.step import StepFunctions  # noqa: E402
from hybrid_jax.metadata import BucketPolicy, ForwardMetadata, RowSpec, build_metadata  # noqa: E402
from hybrid_jax.models.auto import load_checkpoint  # noqa: E402
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind, UnsupportedForwardModeError  # noqa: E402

__all__ = [
    "CAPABILITIES",
    "BucketPolicy",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "ForwardMetadata",
    "ForwardMode",
    "LayerKind",
    "RequestError",
    "Result",
    "RowSpec",
    "SamplingParams",
    "SamplingParamsError",
    "SpeculativeConfig",
    "StepEvent",
    "StepFunctions",
    "UnsupportedForwardModeError",
    "build_metadata",
    "load_checkpoint",
]
