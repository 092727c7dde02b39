"""Loaded weights packed into one huge-page-advised block (neuron_infer.runtime.arena)."""
import torch

from neuron_infer.runtime.arena import ALIGN, pack_weights


def test_packed_tensors_equal_the_originals_and_live_in_one_block():
    torch.manual_seed(0)
    state = {
        "w": torch.randn(70, 96, dtype=torch.bfloat16),
        "b": torch.randn(70),
        "q": torch.randint(-127, 127, (33, 5), dtype=torch.int8),
        "f8": torch.randn(8, 16).to(torch.float8_e4m3fn),
        "t": torch.randn(96, 70).t(),  # non-contiguous source
        "s": torch.tensor(3.5),  # 0-d
        "e": torch.empty(0, 4),
    }
    packed = pack_weights(state)
    assert list(packed) == list(state)
    for k, t in state.items():
        p = packed[k]
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        bits = torch.uint8
        assert torch.equal(p.reshape(-1).view(bits), t.reshape(-1).view(bits))  # bit-exact, fp8 included
    starts = sorted(p.data_ptr() for p in packed.values() if p.numel())
    assert all((a - starts[0]) % ALIGN == 0 for a in starts)  # page-aligned offsets in one mapping
    span = starts[-1] - starts[0]
    assert span < sum((t.numel() * t.element_size() + ALIGN) for t in state.values())


def test_packed_tensors_keep_the_block_alive_and_are_independent_copies():
    src = {"a": torch.arange(10, dtype=torch.float32)}
    a = pack_weights(src)["a"]  # the dict (and any mapping handle) is dropped here
    src["a"].zero_()
    assert torch.equal(a, torch.arange(10, dtype=torch.float32))
    a.add_(1)  # writable, private memory
    assert a[0].item() == 1.0
