"""hybrid_jax: a functional serving backend for hybrid linear-attention models in JAX.

The front door: the engine and its configuration, sampling, the forward modes and their
errors, the metadata builder and the jitted steps. ``docs/DESIGN.md`` describes the
architecture (engine -> model -> layer -> backend -> kernel).
"""

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.engine import Engine
from hybrid_jax.engine.requests import Result, StepEvent
from hybrid_jax.engine.sampling import SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import FinishReason, RequestError
from hybrid_jax.engine.speculative import SpeculativeConfig
from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.metadata import BucketPolicy, ForwardMetadata, RowSpec, build_metadata
from hybrid_jax.models.auto import load_checkpoint
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind, UnsupportedForwardModeError

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
