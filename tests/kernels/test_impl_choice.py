"""How ``impl`` is resolved: explicit choices are honoured or refused, ``auto`` fails closed."""

import pytest

from pallas_kernels import _common
from pallas_kernels._common import resolve_impl


@pytest.fixture(params=[False, True], ids=["cpu", "hopper"])
def on_hopper(request, monkeypatch):
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: request.param)
    return request.param


def test_auto_takes_the_kernel_only_on_hopper_when_it_can_take_the_call(on_hopper):
    assert resolve_impl("op", "auto", None) == ("pallas" if on_hopper else "reference")
    assert resolve_impl("op", "auto", "K=16 is not 64 or 128") == "reference"


def test_explicit_kernel_impl_refuses_a_call_it_cannot_take(on_hopper):
    with pytest.raises(NotImplementedError, match="op: impl='interpret' cannot take this call: "):
        resolve_impl("op", "interpret", "K=16 is not 64 or 128")
    assert resolve_impl("op", "interpret", None) == "interpret"
    assert resolve_impl("op", "reference", "anything") == "reference"


def test_unknown_impl_is_named_in_the_error():
    with pytest.raises(ValueError, match="impl='triton' is not one of"):
        resolve_impl("op", "triton", None)
