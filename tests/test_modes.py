"""Forward modes: the mode table, the capability table and its errors, token layouts."""

import pytest

from hybrid_jax.modes import (
    CAPABILITIES,
    DRAFT,
    MODES,
    TOKEN_LAYOUTS,
    EngineRole,
    ForwardMode,
    LayerKind,
    TokenLayout,
    UnsupportedForwardModeError,
    check_supported,
    modes_for,
    program_mode,
    supported_modes,
    token_layout,
)

M = ForwardMode

BUILT = {M.EXTEND, M.DECODE, M.MIXED, M.IDLE, M.TARGET_VERIFY, M.DRAFT_EXTEND}


def test_enum_lists_every_engine_mode():
    assert {m.name for m in ForwardMode} == {
        "EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2",
        "SPLIT_PREFILL", "DLLM_EXTEND", "PREBUILT",
    }  # fmt: skip


def test_mode_parses_from_value_and_name():
    assert ForwardMode("target_verify") is M.TARGET_VERIFY
    assert ForwardMode("TARGET_VERIFY") is M.TARGET_VERIFY
    with pytest.raises(ValueError, match="not a valid ForwardMode"):
        ForwardMode("verify")


def test_capability_table_every_layer_kind_runs_the_built_modes():
    assert set(CAPABILITIES) == set(LayerKind)
    assert CAPABILITIES[LayerKind.GDN] == BUILT
    assert CAPABILITIES[LayerKind.FULL_ATTENTION] == BUILT
    assert CAPABILITIES[LayerKind.MAMBA2] == BUILT
    assert supported_modes("gdn") == BUILT


def test_capability_table_is_read_only():
    with pytest.raises(TypeError):
        CAPABILITIES[LayerKind.MAMBA2] = frozenset()


@pytest.mark.parametrize(
    ("kind", "mode"),
    [(k, m) for k in LayerKind for m in ForwardMode if m in CAPABILITIES[k]],
    ids=str,
)
def test_supported_pair_passes(kind, mode):
    check_supported(kind, mode)


@pytest.mark.parametrize(
    ("kind", "mode"),
    [(k, m) for k in LayerKind for m in ForwardMode if m not in CAPABILITIES[k]],
    ids=str,
)
def test_unsupported_pair_raises_naming_kind_mode_and_supported_list(kind, mode):
    with pytest.raises(UnsupportedForwardModeError) as info:
        check_supported(kind, mode)
    err = info.value
    assert isinstance(err, NotImplementedError)
    assert (err.layer_kind, err.mode, err.supported) == (kind, mode, CAPABILITIES[kind])
    supported = ", ".join(sorted(m.name for m in CAPABILITIES[kind])) or "none"
    assert str(err) == (
        f"{kind.value} layers do not support forward mode {mode.name}; supported: {supported}"
    )


def test_unsupported_message_matches_the_documented_example():
    with pytest.raises(UnsupportedForwardModeError) as info:
        check_supported(LayerKind.GDN, M.SPLIT_PREFILL)
    assert str(info.value) == (
        "gdn layers do not support forward mode SPLIT_PREFILL; supported: DECODE, DRAFT_EXTEND, "
        "EXTEND, IDLE, MIXED, TARGET_VERIFY"
    )


def test_token_layouts_cover_exactly_the_modes_some_layer_supports():
    assert set(TOKEN_LAYOUTS) == set().union(*CAPABILITIES.values())


def test_token_layout_per_mode():
    assert token_layout(M.EXTEND) == "ragged"
    assert token_layout(M.MIXED) is TokenLayout.RAGGED
    assert token_layout(M.DRAFT_EXTEND) is TokenLayout.RAGGED
    assert token_layout(M.DECODE) == "one_per_row"
    assert token_layout(M.TARGET_VERIFY) == "draft_per_row"
    assert token_layout(M.IDLE) == "empty"


def test_token_layout_of_unbuilt_mode_raises_without_layer_kind():
    with pytest.raises(UnsupportedForwardModeError, match="no token layout for .* PREBUILT") as e:
        token_layout(M.PREBUILT)
    assert e.value.layer_kind is None
    assert e.value.supported == frozenset(TOKEN_LAYOUTS)


def test_mode_table_has_one_row_per_built_mode_and_the_layouts_are_its_view():
    assert set(MODES) == BUILT
    assert dict(TOKEN_LAYOUTS) == {mode: spec.layout for mode, spec in MODES.items()}
    assert not MODES[M.IDLE].has_rows and all(MODES[m].has_rows for m in BUILT - {M.IDLE})
    # Rows of fixed tokens-per-row layouts carry exactly that many tokens.
    for spec in MODES.values():
        if spec.layout in (TokenLayout.ONE_PER_ROW, TokenLayout.DRAFT_PER_ROW):
            assert spec.min_row_tokens == spec.max_row_tokens == spec.tokens_per_row
    assert MODES[M.TARGET_VERIFY].tokens_per_row == DRAFT
    assert MODES[M.DECODE].num_draft_tokens == 1


def test_each_engine_role_compiles_the_modes_its_rows_name():
    assert modes_for(EngineRole.SERVING) == (M.EXTEND, M.MIXED, M.DECODE)
    assert modes_for(EngineRole.VERIFYING) == (M.EXTEND, M.TARGET_VERIFY)
    assert modes_for(EngineRole.DRAFTING) == (M.EXTEND, M.DECODE, M.DRAFT_EXTEND)
    assert all(M.IDLE not in modes_for(role) for role in EngineRole)


def test_rows_that_compute_alike_compare_equal_whatever_their_roles_and_hints():
    assert MODES[M.MIXED] == MODES[M.EXTEND]
    assert MODES[M.MIXED].roles != MODES[M.EXTEND].roles
    assert program_mode(M.MIXED) is M.EXTEND and program_mode(M.DECODE) is M.DECODE
    verify = MODES[M.TARGET_VERIFY].resolved(3)
    assert (verify.min_row_tokens, verify.max_row_tokens, verify.tokens_per_row) == (3, 3, 3)
    assert verify.num_draft_tokens == 3 and verify.roles == MODES[M.TARGET_VERIFY].roles
    assert MODES[M.DECODE].resolved(3) == MODES[M.DECODE]
