"""benchmarks/serve.py stays runnable: its --smoke rows (tiny model, CPU) all measure, and
its limits follow the model's dimensions."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("serve", ROOT / "benchmarks" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["serve"]
    sys.modules.pop("serve_presets", None)
    sys.modules.pop("switches", None)
    sys.modules.pop("hlo_census", None)
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def presets(serve):
    """``benchmarks/serve_presets.py``, as serve.py imports it."""
    return sys.modules["serve_presets"]


def test_smoke_rows_all_measure_and_write_results(serve, tmp_path, cache_dir):
    # The run's cache (serve.py's default is a new empty folder): the compile-only tests below
    # load the engines these rows build.
    flags = ["--smoke", "--hlo", "--out", str(tmp_path), "--cache-dir", cache_dir]
    assert serve.main(flags) == 0
    text = (tmp_path / "RESULTS_serve_smoke.md").read_text()
    rows = [
        line for line in text.splitlines() if line.startswith(("| decode", "| prefill", "| stream"))
    ]
    assert len(rows) == 3 and not any("failed" in row for row in rows), text
    # --verify: a speculative row of every step verifying its drafts, with the tokens kept.
    (verify,) = [line for line in text.splitlines() if line.startswith("| verify B=2 D=3")]
    assert "failed" not in verify and "tokens kept a row a step" in text, text
    stream = rows[2]
    assert "ITL p50/p90/p99" in stream and "TTFT p50/p90/p99" in text, text
    # The decode row's note gives the spread of the steps whose median it reports.
    assert "2 steps, 10th-90th percentile" in text and "; ;" not in text, text
    # The flags XLA ran with head the results (the serving flags hybrid_jax adds among them).
    assert "XLA_FLAGS `" in text and "--xla_gpu_dot_merger_threshold_mb=0" in text, text
    assert "decode steps as whole CUDA graphs: no" in text, text
    # --hlo: the decode row's executable as XLA optimised it.
    (hlo,) = tmp_path.glob("hlo_smoke_decode_*.txt")
    assert hlo.read_text().startswith("HloModule")


def test_compile_only_rows_report_the_kernel_census_of_their_hlo(serve, tmp_path, cache_dir):
    flags = ["--smoke", "--compile-only", "--hlo", "--out", str(tmp_path), "--cache-dir", cache_dir]
    assert serve.main(flags) == 0
    text = (tmp_path / "RESULTS_serve_smoke.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 1 and rows[0].startswith("| decode B=2") and "compiled" in rows[0], text
    (hlo,) = tmp_path.glob("hlo_smoke_decode_*.txt")
    counted = sys.modules["hlo_census"].census(hlo.read_text())
    assert counted.loops and counted.total > 0
    assert f"{counted.total} kernels a step" in text, text


def test_each_switch_runs_the_rows_again_with_one_switch_at_a_time(
    serve, tmp_path, capsys, monkeypatch, cache_dir
):
    from hybrid_jax.layers import moe

    seen = []
    rows = serve.variant_rows

    def recording(model, c, args, rng, label):
        seen.append((label, moe.SHARED_HIDDEN_WITH_EXPERTS, moe.SPLIT_ROUTER_LAUNCH))
        return rows(model, c, args, rng, label)

    flags = ["--smoke", "--compile-only", "--out", str(tmp_path), "--cache-dir", cache_dir]
    monkeypatch.setattr(serve, "variant_rows", recording)
    trials = "no-shared-hidden-with-experts,no-split-router-launch+no-shared-hidden-with-experts"
    assert serve.main([*flags, "--each-switch", trials]) == 0
    one = "MoE ragged_dot, --no-shared-hidden-with-experts"
    both = "MoE ragged_dot, --no-split-router-launch --no-shared-hidden-with-experts"
    assert seen == [("MoE ragged_dot", True, True), (one, False, True), (both, False, False)]
    assert moe.SHARED_HIDDEN_WITH_EXPERTS is True and moe.SPLIT_ROUTER_LAUNCH is True
    with pytest.raises(SystemExit):
        serve.main([*flags, "--each-switch", "no-such-switch"])
    assert "'--no-such-switch'] are not trial switches" in capsys.readouterr().err


def test_every_trial_switch_is_part_of_the_executables_cache_key(serve):
    """A switch the engine's cache key leaves out would give its rows the executable traced
    without it (a switched row compiling in seconds)."""
    from hybrid_jax.engine import startup

    keyed = {(module, name) for module, names in startup._SWITCHES.items() for name in names}
    trial = {(module.__name__, name) for module, name, _, _ in serve.TRIAL_SWITCHES.values()}
    # Read when a step compiles, not while it is traced: it changes the compile's options,
    # which JAX's compilation cache keys, not the stored program.
    compiled = {("hybrid_jax.xla_flags", "STEP_GRAPHS")}
    assert compiled <= trial and trial - compiled <= keyed, sorted(trial - compiled - keyed)


def test_a_trial_switch_holds_for_the_rows_and_is_put_back_after(serve, tmp_path, monkeypatch):
    """``--no-norms-in-launch`` is set while the rows run and as it was after, raised or not."""
    from hybrid_jax.layers import linear

    seen = []

    def rows(*args, **kwargs):
        seen.append(linear.NORMS_IN_LAUNCH)
        raise RuntimeError("row failed")

    monkeypatch.setattr(serve, "variant_rows", rows)
    with pytest.raises(RuntimeError, match="row failed"):
        serve.main(["--smoke", "--no-norms-in-launch", "--out", str(tmp_path)])
    assert seen == [False] and linear.NORMS_IN_LAUNCH is True


@pytest.mark.slow  # under a minute on two cores; the Qwen presets' rows run by default
def test_the_nemotron_h_preset_runs_and_its_limit_follows_the_model(serve, presets, tmp_path):
    assert serve.main(["--smoke", "--preset", "nemotron-smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS_serve_smoke.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(rows) == 2 and not any("failed" in row for row in rows), text
    config = presets.PRESETS["nemotron-h-8b-like"][1](52)
    blocks = config.layers_block_type
    assert (blocks.count("linear_attention"), blocks.count("mlp")) == (24, 24)
    assert blocks.count("full_attention") == 4
    small = presets.PRESETS["nemotron-smoke"][1](8)
    model = serve.NemotronH(small, rngs=serve.nnx.Rngs(0))
    weights = presets.parameter_count(model) * 4  # float32
    # Batch 1 at 64 positions: the weights, one row's states (read and written) and its KV.
    states = sum(spec.slot_bytes for spec in model.state_specs())
    kv = sum(2 * s.num_kv_heads * s.head_dim * 4 for s in model.kv_specs())
    assert presets.limit_bytes(model, small, 1, 64) == weights + 2 * states + 64 * kv
    one_prompt = presets.limit_flops(model, small, 1, 64)
    assert presets.limit_flops(model, small, 2, 64) > 2 * one_prompt * 0.99


def test_decode_limit_counts_only_the_experts_a_batch_can_touch(presets):
    config = presets.PRESETS["qwen3-next-80b-a3b"][1](4)
    one, many = presets.decode_bytes(config, 1, 64), presets.decode_bytes(config, 256, 64)
    expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # bf16
    moe_layers = sum(config.is_moe_layer(i) for i in range(4))
    # Batch 1 reads top_k experts per MoE layer; batch 256 nearly all 512 of them.
    assert (
        many - one > 0.9 * moe_layers * (config.num_experts - config.num_experts_per_tok) * expert
    )
    one_prompt = presets.prefill_flops(config, 1, 1024)
    assert presets.prefill_flops(config, 2, 1024) > 2 * one_prompt * 0.99


def test_decode_roofline_is_the_byte_limit_until_the_rows_make_products_flop_bound(presets):
    config = presets.PRESETS["qwen3.5-9b-like"][1](4)
    bandwidth, flops = 4.3e12, 7.9e14  # the ridge: ~184 rows
    for batch in (1, 64):
        limit = presets.decode_bytes(config, batch, 64) / bandwidth
        roof = presets.decode_roofline_s(config, batch, 64, bandwidth, flops)
        assert roof == pytest.approx(limit)
    # At 256 rows each dense product takes its FLOPs: 2 x 256 x parameters.
    roof = presets.decode_roofline_s(config, 256, 64, bandwidth, flops)
    rows = presets.row_bytes(config, 256, 64) / bandwidth
    params = (presets.decode_bytes(config, 256, 64) - presets.row_bytes(config, 256, 64)) / 2
    assert roof == pytest.approx(rows + 2 * 256 * params / flops)


@pytest.mark.parametrize("flag", [[], ["--no-fold-norm-weights"]], ids=["folded", "not-folded"])
def test_the_rows_model_is_folded_once_unless_the_run_says_not(serve, tmp_path, monkeypatch, flag):
    """The layers stacked once for every row are folded there (``--no-fold-norm-weights``
    leaves them, and says so in the rows' label)."""
    from hybrid_jax.models.layer_scan import ScannedRun

    seen = []

    def recording(model, c, args, rng, label):
        runs = [layer for layer in model.layers if isinstance(layer, ScannedRun)]
        seen.append((label, {block.input_layernorm.folded for run in runs for block in run.blocks}))
        return []

    monkeypatch.setattr(serve, "variant_rows", recording)
    monkeypatch.setattr(serve, "_plot", lambda path, rows: None)  # no rows to plot
    assert serve.main(["--smoke", "--compile-only", "--out", str(tmp_path), *flag]) == 0
    (label, folded), *_ = seen
    assert folded == {not flag}
    assert ("norm weights not folded" in label) is bool(flag)


def test_the_sequence_table_is_the_last_profiled_steps_launches_from_its_start(serve):
    """Two equal steps of three launches (ns): the last step's, in microseconds from its own
    first start."""
    events = [("a", 1000, 500), ("b", 3000, 250), ("c", 5000, 100),
              ("a", 9000, 400), ("b", 9500, 300), ("c", 12000, 200)]  # fmt: skip
    assert serve._last_step(events, 2) == [("a", 0.0, 0.4), ("b", 0.5, 0.3), ("c", 3.0, 0.2)]
    assert serve._last_step([], 2) == []


def test_launches_back_to_back_keep_the_short_gaps_and_set_the_host_s_apart(serve):
    """Launches (us): a 0.5 gap counts with the device, an 8 us one is the host's; an
    overlap (a launch starting before the one before it ends) adds no negative gap."""
    sequence = [("a", 0.0, 2.0), ("b", 2.5, 1.0), ("c", 11.5, 3.0), ("d", 14.0, 1.0)]
    bound, host = serve.device_bound_us(sequence)
    assert bound == pytest.approx(2.0 + 1.0 + 3.0 + 1.0 + 0.5)
    assert host == pytest.approx(8.0)
    assert serve.device_bound_us([("a", 0.0, 2.0)]) == (2.0, 0.0)


def test_the_host_table_sums_each_threads_events_per_step_longest_first(serve, tmp_path):
    """A jitted call profiled 4 times on this machine's CPU: the host plane's dispatch events
    (nested, so a whole number of them a call) come back per call, on the python thread,
    longest first; a profile without a host plane gives an empty table."""
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((32, 32))
    f(x).block_until_ready()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(tmp_path), profiler_options=options):
        for _ in range(4):
            y = f(x)
        y.block_until_ready()
    profile = jax.profiler.ProfileData.from_file(str(next(tmp_path.rglob("*.xplane.pb"))))
    table = serve.host_table(profile, 4)
    us = [row[3] for row in table]
    assert us == sorted(us, reverse=True) and us[0] > 0
    dispatch = [row for row in table if row[1] == "PjitFunction(<lambda>)"]
    assert len(dispatch) == 1
    thread, _, calls, _ = dispatch[0]
    assert thread == "python" and calls >= 1 and calls == pytest.approx(round(calls))

    class NoHost:
        def find_plane_with_name(self, name):
            return None

    assert serve.host_table(NoHost(), 4) == []


def test_a_profile_gives_its_note_and_three_tables(serve, tmp_path):
    """A made-up profile of two kernels, a host stall and two host events (us; back to back
    3 + 1 + 3 and the 0.5 gap): the note counts
    the launches, sets the stall apart and names the longest of each; the tables hold every
    kernel, launch and host event."""
    profile = serve.StepProfile(
        categories={"matmuls (XLA/cuBLAS)": 6.0, "other fusions": 1.0},
        kernels=[("gemm", 2.0, 6.0), ("fusion", 1.0, 1.0)],
        wall_us=20.0,
        sequence=[("gemm", 0.0, 3.0), ("fusion", 3.5, 1.0), ("gemm", 12.5, 3.0)],
        host=[("python", "PjitFunction(step)", 1.0, 15.0), ("python", "DevicePut", 3.0, 4.5)],
    )
    note = serve.breakdown_note(profile)
    assert note.startswith("3 kernels/step; its launches back to back 8 us (host stalls 8 us")
    assert "idle 65% of 20 us" in note and "top: gemm 6; fusion 1" in note
    host_part = "host us/step (inclusive): python PjitFunction(step) 15; python DevicePut 4"
    assert note.endswith(host_part)
    table = tmp_path / "kernels_row.tsv"
    serve.write_tables(profile, table)
    assert table.read_text().splitlines()[1:] == ["6.0\t2\tgemm", "1.0\t1\tfusion"]
    assert len(table.with_suffix(".sequence.tsv").read_text().splitlines()) == 4
    host = table.with_suffix(".host.tsv").read_text().splitlines()
    assert host[2] == "4.5\t3\tpython\tDevicePut"


@pytest.mark.parametrize("spec", ["1x", "0x4", "1x1", "1x9", "2-4"])
def test_a_bad_verify_row_is_refused_before_any_model_is_built(serve, spec, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--verify", spec])  # refused before the default preset is built
    err = capsys.readouterr().err
    assert "--verify" in err and repr(spec) in err, err


@pytest.mark.parametrize(
    ("kernel", "category"),
    [
        ("gdn_decode_ring_mosaic_gpu_kernel", "GDN/Mamba2 kernels"),
        ("conv1d_update_mosaic_gpu_kernel", "GDN/Mamba2 kernels"),
        ("paged_decode_attention_mosaic_gpu_kernel", "attention"),
        ("attention_rows_mosaic_gpu_kernel", "attention"),
        ("expert_mlp_mosaic_gpu_kernel", "MoE (routed experts, combine)"),
        ("expert_matmul_mosaic_gpu_kernel", "MoE (routed experts, combine)"),
        ("combine_pairs_mosaic_gpu_kernel", "MoE (routed experts, combine)"),
        ("projection_add_mosaic_gpu_kernel", "projections (Pallas)"),
        ("projections_mosaic_gpu_kernel", "projections (Pallas)"),
        ("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_NNT", "matmuls (XLA/cuBLAS)"),
        ("memcpy32_post", "copies/transposes"),
        ("input_reduce_fusion_7", "other fusions"),
    ],
)
def test_each_kernel_of_a_step_falls_in_its_category(serve, kernel, category):
    """Our own kernels by what they do: an expert product is MoE and an attention kernel
    attention, not the matmuls or other fusions their names would otherwise fall in."""
    assert serve._category(kernel) == category
