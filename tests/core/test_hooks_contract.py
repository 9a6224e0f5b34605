"""The saved-tensor hooks contract torch_remat documents, on remat_dist.

What an activation offloader relies on: ``SavedTensorInfo(kind, context)``;
``capture_context`` called where a tensor is produced and its value visible from
the pack hook; outputs persisted after the producer's hooks exited still packed by
those hooks with the producer's context; no unpack of what a checkpoint keeps
before its replay starts, save-region outputs unpacked during the replay in pack
order before the other unpacks; a plain torch pair nested inside taking over.
"""

from __future__ import annotations

import torch

import remat_dist as remat
import remat_dist.testing
from remat_dist import SavedTensorInfo, SavedTensorKind

torch.manual_seed(0)
W1 = torch.randn(8, 8, requires_grad=True)
W2 = torch.randn(8, 8, requires_grad=True)
X0 = torch.randn(4, 8)


def _grads(fn, x0=X0):
    W1.grad = W2.grad = None
    x = x0.clone().requires_grad_()
    fn(x).sum().backward()
    out = [x.grad, W1.grad, W2.grad]
    W1.grad = W2.grad = None
    return out


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _reference(x):
    return (torch.exp(x @ W1) @ W2).sin() @ W1


def test_saved_tensor_info_has_torch_remats_shape():
    info = SavedTensorInfo(SavedTensorKind.SAVE_OUTPUT, "chunk 3")
    assert (info.kind, info.context) == (SavedTensorKind.SAVE_OUTPUT, "chunk 3")
    assert info.checkpoint is None and info.region is None and info.name is None
    assert SavedTensorInfo(SavedTensorKind.BACKWARD).context is None


class _Log:
    """Hooks that log (event, kind, context) and return the tensor."""

    def __init__(self, chunk):
        self.events = []
        self.chunk = chunk

    def hooks(self):
        def pack(t):
            info = remat.current_saved_tensor_info()
            self.events.append(("pack", info.kind, info.context, info.region))
            return (len(self.events), t)

        def unpack(packed):
            self.events.append(("unpack", packed[0]))
            return packed[1]

        return remat.saved_tensors_hooks(
            pack, unpack, capture_context=lambda: self.chunk[0]
        )


def test_capture_context_is_taken_where_the_tensor_is_produced():
    chunk = [1]
    log = _Log(chunk)

    def block(x):
        with log.hooks():
            y = remat.region(lambda t: torch.exp(t @ W1), "exp", recompute=False)(x)
        chunk[0] = 2  # the offloader moved on; y still belongs to chunk 1
        remat.recompute_needs_tensor(y)  # persisted after the hooks exited
        return (y @ W2).sin() @ W1

    got = _grads(lambda x: remat.checkpoint(region_name="c")(block)(x))
    packs = [e[1:] for e in log.events if e[0] == "pack"]
    assert (SavedTensorKind.BACKWARD, 1, "c::exp") in packs
    # packed by the producer's hooks, with the producer's context
    assert (SavedTensorKind.SAVE_OUTPUT, 1, "c::exp") in packs
    assert all(ctx == 1 for _, ctx, _ in packs)
    assert _equal(got, _grads(_reference))


def test_checkpoint_inputs_and_saves_outside_get_no_context():
    log = _Log([7])

    def block(x):
        y = remat.region(lambda t: torch.exp(t @ W1), "exp", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return (y @ W2).sin() @ W1

    with log.hooks():
        out = remat.checkpoint(region_name="c")(block)(X0.clone().requires_grad_())
        out = out.exp()  # outside any checkpoint
    packs = [e[1:3] for e in log.events if e[0] == "pack"]
    assert (SavedTensorKind.CHECKPOINT_INPUT, None) in packs
    assert (SavedTensorKind.BACKWARD, 7) in packs  # the save region's save
    assert packs[-1] == (SavedTensorKind.BACKWARD, None)  # exp's output, outside
    out.sum().backward()


def test_no_unpack_before_the_replay_starts_and_outputs_first_in_pack_order():
    """A trailing save region's nodes run first in backward; its unpacks must still
    wait for the replay, which unpacks the persisted outputs in pack order."""
    log = _Log([0])

    def block(x):
        if remat.is_recomputing():
            log.events.append(("replay start",))
        a = remat.region(lambda t: torch.exp(t @ W1), "a", recompute=False)(x)
        b = remat.region(lambda t: torch.exp(t @ W2), "b", recompute=False)(a.sin())
        remat.recompute_needs_tensor(a, b)
        h = (a * b).sin()
        # a trailing save region: backward reaches its nodes before any other
        return remat.region(lambda t: torch.tanh(t @ W1), "tail", recompute=False)(h)

    with log.hooks():
        got = _grads(lambda x: remat.checkpoint(region_name="c")(block)(x))
    assert _equal(got, _grads(lambda x: block(x)))
    ev = log.events
    start = ev.index(("replay start",))
    # torch's checkpoint unpacks the checkpoint's input (pack 1) to start the
    # replay; everything else waits for it
    unpacks = [i for i, e in enumerate(ev) if e[0] == "unpack" and e[1] != 1]
    assert len(unpacks) == 8 and min(unpacks) > start, ev
    output_packs = [
        i + 1 for i, e in enumerate(ev) if e[0] == "pack" and e[1] is SavedTensorKind.SAVE_OUTPUT
    ]
    served = [e[1] for e in ev[start:] if e[0] == "unpack"][: len(output_packs)]
    assert served == output_packs  # before any other unpack, in pack order


class _ChunkOffloader:
    """A bulk offloader: packs go to the chunk captured where they were produced;
    the replay's start fetches every chunk at once (an unpack before that would
    fail). Checkpoint inputs, which torch's checkpoint unpacks to start the
    replay, are fetched one by one."""

    def __init__(self):
        self.chunk = 0
        self.stored = {}
        self.ready = None
        self.fetches = 0

    def hooks(self):
        def pack(t):
            info = remat.current_saved_tensor_info()
            if info.kind is SavedTensorKind.CHECKPOINT_INPUT:
                return "input", t.to("cpu", copy=True), t.device
            chunk = self.chunk if info.context is None else info.context
            items = self.stored.setdefault(chunk, [])
            items.append(t.to("cpu", copy=True))
            return chunk, len(items) - 1, t.device

        def unpack(packed):
            chunk, i, device = packed
            if chunk == "input":
                return i.to(device)
            return self.ready[chunk][i].to(device)

        return remat.saved_tensors_hooks(pack, unpack, capture_context=lambda: self.chunk)

    def prefetch(self):
        self.ready, self.stored = self.stored, {}
        self.fetches += 1


def test_bulk_offloader_that_prefetches_at_replay_start():
    off = _ChunkOffloader()

    def block(x):
        if remat.is_recomputing():
            off.prefetch()
        y = remat.region(lambda t: torch.exp(t @ W1), "exp", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        h = (y @ W2).sin()
        return remat.region(lambda t: torch.tanh(t @ W1), "tail", recompute=False)(h)

    def run(x):
        with off.hooks():
            return remat.checkpoint(region_name="c")(block)(x)

    got = _grads(run)
    assert off.fetches == 1 and sum(map(len, off.ready.values())) >= 3
    assert _equal(got, _grads(lambda x: block(x)))


def test_plain_torch_hooks_nested_inside_take_over():
    outer, inner = [], []

    def inner_pack(t):
        inner.append(t.shape)
        return t

    with remat.saved_tensors_hooks(lambda t: outer.append(t) or t, lambda t: t):
        with torch.autograd.graph.saved_tensors_hooks(inner_pack, lambda t: t):

            def block(x):
                y = remat.region(lambda t: torch.exp(t @ W1), "exp", recompute=False)(x)
                remat.recompute_needs_tensor(y)
                return (y @ W2).sin() @ W1

            x = X0.clone().requires_grad_()
            out = remat.checkpoint(region_name="c")(block)(x)
    assert outer == []
    # the checkpoint input, the region's saves (x @ W1: x and W1; exp: its output)
    # and its persisted output all went to the inner pair
    assert (4, 8) in inner and (8, 8) in inner and len(inner) >= 4
    out.sum().backward()
    got = [x.grad, W1.grad, W2.grad]
    W1.grad = W2.grad = None
    assert _equal(got, _grads(lambda x: block(x)))


def test_hooks_entered_inside_a_checkpoint_see_only_save_regions():
    seen = []

    def pack(t):
        seen.append(remat.current_saved_tensor_info().region)
        return t

    def block(x):
        with remat.saved_tensors_hooks(pack, lambda t: t):
            y = remat.region(lambda t: torch.exp(t @ W1), "exp", recompute=False)(x)
            remat.recompute_needs_tensor(y)
            h = (y @ W2).sin()  # recomputed, never packed by the hooks
        return h @ W1

    counter = remat_dist.testing.SavedBytesCounter()
    with counter:
        out = remat.checkpoint(region_name="c")(block)(X0.clone().requires_grad_())
    assert seen and set(seen) == {"c::exp"}
    # only the checkpoint's input reached the outer hooks: the rest is recomputed
    assert counter.activation_bytes == X0.nbytes
    out.sum().backward()
    got = [W1.grad, W2.grad]
    ref = _grads(lambda x: (torch.exp(x @ W1) @ W2).sin() @ W1)[1:]
    assert _equal(got, ref)


def test_a_saved_parameter_reaches_the_pack_hook_as_a_parameter():
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.offload = False  # a per-tensor marker an offloader reads
    kinds = []

    def pack(t):
        kinds.append((isinstance(t, torch.nn.Parameter), getattr(t, "offload", None)))
        return t

    def block(x):
        y = remat.region(lambda t: t @ w, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return y.sin()

    with remat.saved_tensors_hooks(pack, lambda t: t):
        out = remat.checkpoint(region_name="c")(block)(X0.clone().requires_grad_())
    assert (True, False) in kinds
    out.sum().backward()
    assert w.grad is not None
