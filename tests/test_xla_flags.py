"""The XLA flags hybrid_jax adds at import: added when absent, a user's value kept."""

from __future__ import annotations

import logging
import os

import pytest
from jax._src import xla_bridge

from hybrid_jax import xla_flags
from hybrid_jax.xla_flags import (
    SERVING_XLA_FLAGS,
    STEP_GRAPH_OPTIONS,
    add_serving_flags,
    step_compiler_options,
)


@pytest.fixture
def fresh_backend(monkeypatch):
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)


def test_absent_flags_are_added_and_a_users_value_is_kept(monkeypatch, fresh_backend):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_foo=1")
    add_serving_flags()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[:2] == ["--xla_gpu_enable_triton_gemm=true", "--xla_foo=1"]
    assert flags[2:] == [f for f in SERVING_XLA_FLAGS if "triton_gemm" not in f]
    add_serving_flags()  # idempotent
    assert os.environ["XLA_FLAGS"].split() == flags
    monkeypatch.delenv("XLA_FLAGS")
    add_serving_flags()
    assert os.environ["XLA_FLAGS"].split() == list(SERVING_XLA_FLAGS)


def test_command_buffer_flags_are_never_added_to_the_process(monkeypatch, fresh_backend):
    # Whole-step graphs are a decode step's compile option (step_compiler_options), so a
    # prefill step in the same process keeps XLA's defaults.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    add_serving_flags()
    assert not any("command_buffer" in f or "graph" in f for f in os.environ["XLA_FLAGS"].split())


def test_step_graph_options_are_given_when_asked_for_and_a_users_flags_win(monkeypatch):
    monkeypatch.setattr(xla_flags, "STEP_GRAPHS", True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    assert step_compiler_options(True) == STEP_GRAPH_OPTIONS
    assert step_compiler_options(False) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_gpu_graph_min_graph_size=4")
    assert step_compiler_options(True) == {}  # the user chose the graphs' size
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    monkeypatch.setattr(xla_flags, "STEP_GRAPHS", False)  # without HYBRID_JAX_STEP_GRAPHS=1
    assert step_compiler_options(True) == {}


def test_opt_out_leaves_the_flags_alone(monkeypatch, fresh_backend):
    monkeypatch.setenv("HYBRID_JAX_KEEP_XLA_FLAGS", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    add_serving_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1"


def test_a_started_backend_is_named_in_a_warning_and_left_alone(monkeypatch, caplog):
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    with caplog.at_level(logging.WARNING, logger="hybrid_jax.xla_flags"):
        add_serving_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1"
    assert all(flag in caplog.text for flag in SERVING_XLA_FLAGS)
