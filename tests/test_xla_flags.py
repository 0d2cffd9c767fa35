"""The XLA flags hybrid_jax adds at import: added when absent, a user's value kept."""

from __future__ import annotations

import logging
import os

import pytest
from jax._src import xla_bridge

from hybrid_jax.xla_flags import SERVING_XLA_FLAGS, STEP_GRAPH_XLA_FLAGS, add_serving_flags


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


def test_step_graphs_are_added_only_when_asked_for(monkeypatch, fresh_backend):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("HYBRID_JAX_STEP_GRAPHS", raising=False)
    add_serving_flags()
    assert not any("command_buffer" in f for f in os.environ["XLA_FLAGS"].split())
    monkeypatch.setenv("HYBRID_JAX_STEP_GRAPHS", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=4")
    add_serving_flags()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_graph_min_graph_size=4"  # the user's value is kept
    assert flags[1:] == [*SERVING_XLA_FLAGS, STEP_GRAPH_XLA_FLAGS[0]]


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
