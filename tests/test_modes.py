"""Forward-mode predicates, the capability table and its errors, token layouts."""

import pytest

from hybrid_jax.modes import (
    CAPABILITIES,
    TOKEN_LAYOUTS,
    ForwardMode,
    LayerKind,
    TokenLayout,
    UnsupportedForwardModeError,
    check_supported,
    supported_modes,
    token_layout,
)

M = ForwardMode

# Each predicate and exactly the modes it must answer True for.
PREDICATES = {
    "is_extend": {M.EXTEND, M.MIXED, M.DRAFT_EXTEND, M.DRAFT_EXTEND_V2, M.SPLIT_PREFILL,
                  M.DLLM_EXTEND},
    "is_decode": {M.DECODE},
    "is_idle": {M.IDLE},
    "is_decode_or_idle": {M.DECODE, M.IDLE},
    "is_mixed": {M.MIXED},
    "is_target_verify": {M.TARGET_VERIFY},
    "is_draft_extend": {M.DRAFT_EXTEND, M.DRAFT_EXTEND_V2},
    "is_speculative": {M.TARGET_VERIFY, M.DRAFT_EXTEND, M.DRAFT_EXTEND_V2},
    "is_split_prefill": {M.SPLIT_PREFILL},
    "is_dllm_extend": {M.DLLM_EXTEND},
    "is_prebuilt": {M.PREBUILT},
}  # fmt: skip

BUILT = {M.EXTEND, M.DECODE, M.MIXED, M.IDLE, M.TARGET_VERIFY, M.DRAFT_EXTEND}


def test_enum_lists_every_engine_mode():
    assert {m.name for m in ForwardMode} == {
        "EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2",
        "SPLIT_PREFILL", "DLLM_EXTEND", "PREBUILT",
    }  # fmt: skip


@pytest.mark.parametrize("predicate", sorted(PREDICATES))
@pytest.mark.parametrize("mode", list(ForwardMode), ids=lambda m: m.name)
def test_predicate_is_true_exactly_on_its_modes(predicate, mode):
    assert getattr(mode, predicate)() is (mode in PREDICATES[predicate])


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
