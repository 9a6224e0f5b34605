"""Stand-ins: a replay that fails and is absorbed by an observer (what the
distributed layer does so that every rank's backward still pairs its collectives)
is completed with zero tensors built from what the forward noted of its saves.
After its first forward a call site notes less (shape, dtype, device, class);
these tests pin that it still completes, for plain tensors and for a tensor
subclass (whose structure comes from the first forward), and that a site that
starts saving a tensor subclass raises instead of handing torch a wrong stand-in.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import remat_dist as remat
from remat_dist import RematError
from remat_dist.core import live_records, register_observer


class _Absorb:
    """An observer that absorbs every failed replay (and remembers it)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def on_replay_error(self, record, error) -> bool:
        self.errors.append(f"{record.name}: {error}")
        return True


class _Tagged(torch.Tensor):
    """A tensor subclass without ``__tensor_flatten__``; ops on it return it."""


def _site(name: str, fail: dict[str, bool]):
    def body(t):
        if fail["now"] and remat.is_recomputing():
            raise RuntimeError("replay broke")
        return t.sin().exp()

    return remat.checkpoint(region_name=name)(body)


def _meta_of(name: str) -> list[tuple]:
    (record,) = [r for r in live_records() if r.name == name]
    return list(record.saved_meta)


@pytest.fixture
def absorb():
    observer = _Absorb()
    handle = register_observer(observer)
    yield observer
    handle.remove()


def test_a_plain_site_notes_less_from_its_second_call_and_still_completes(absorb):
    fail = {"now": False}
    fn = _site("st_plain", fail)
    x = torch.randn(4, 3, requires_grad=True)
    shapes = []
    for call in range(3):
        fail["now"] = call == 2
        y = fn(x)
        meta = _meta_of("st_plain")
        shapes.append(sorted(len(m) for m in meta))
        x.grad = None
        y.sum().backward()
        if call < 2:
            torch.testing.assert_close(x.grad, (x.sin().exp() * x.cos()).detach())
    # the first forward notes strides (and a subclass's structure); later ones do not
    assert shapes[0][0] == 5 and shapes[1][0] == 4 and shapes[2][0] == 4
    # the failed third replay was absorbed and completed with zero saved tensors:
    # exp's saved result is zero, so the gradient is zero, with the right shape
    assert absorb.errors == ["st_plain: replay broke"]
    assert torch.equal(x.grad, torch.zeros(4, 3))


def test_a_subclass_site_notes_less_from_its_second_call_and_still_completes(absorb):
    fail = {"now": False}
    fn = _site("st_two", fail)
    x = TwoTensor(torch.randn(4, 3), torch.randn(4, 3)).requires_grad_()
    lengths = []
    for call in range(3):
        fail["now"] = call == 2
        y = fn(x)
        lengths.append({len(m) for m in _meta_of("st_two")})
        x.grad = None
        y.sum().backward()
        if call < 2:
            want = x.detach().sin().exp() * x.detach().cos()
            assert torch.allclose(x.grad.a, want.a) and torch.allclose(x.grad.b, want.b)
    # the first forward notes a TwoTensor's structure; later ones one C call each
    assert lengths == [{5}, {4}, {4}]
    # the failed third replay completed with TwoTensor stand-ins built from the
    # first forward's structure: a zero gradient of the input's own type
    assert absorb.errors == ["st_two: replay broke"]
    assert type(x.grad) is TwoTensor
    assert torch.equal(x.grad.a, torch.zeros(4, 3)) and torch.equal(x.grad.b, torch.zeros(4, 3))


def test_a_subclass_site_whose_kinds_change_notes_in_full_again(absorb):
    fn = _site("st_kinds", {"now": False})
    x = TwoTensor(torch.randn(4, 3), torch.randn(4, 3)).requires_grad_()
    fn(x).sum().backward()  # full
    fn(x).sum().backward()  # plain, the same kinds: structure from the first
    wider = TwoTensor(torch.randn(4, 5), torch.randn(4, 5)).requires_grad_()
    fn(wider).sum().backward()  # plain, other shapes: the next notes in full
    y = fn(wider)
    assert {len(m) for m in _meta_of("st_kinds")} == {5}
    y.sum().backward()


def test_a_site_that_starts_saving_a_subclass_raises_instead_of_a_wrong_stand_in(absorb):
    fail = {"now": False}
    fn = _site("st_sub", fail)
    x = torch.randn(4, 3, requires_grad=True)
    fn(x).sum().backward()  # plain: the next forward notes the plain way

    tagged = x.detach().as_subclass(_Tagged).requires_grad_()
    fail["now"] = True
    y = fn(tagged)
    with pytest.raises(RematError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "'st_sub'" in text and "saved a _Tagged" in text
    assert "Fix: make the checkpoint save the same kinds of tensors" in text
    del y, info  # the failed graph and its record
    gc.collect()

    # that forward taught the site: the next one notes the full metadata, so its
    # failed replay completes again
    y = fn(tagged)
    assert all(len(m) == 5 for m in _meta_of("st_sub"))
    y.sum().backward()
    assert torch.equal(tagged.grad, torch.zeros(4, 3))
    assert absorb.errors == ["st_sub: replay broke"] * 2
