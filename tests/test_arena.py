"""Loaded weights packed into one huge-page-advised block (neuron_infer.artifact.arena, compile.weights.read_packed)."""
import pytest
import torch
from safetensors.torch import save_file

from neuron_infer.artifact.arena import ALIGN, pack_weights
from neuron_infer.artifact.weights import read_packed
from neuron_infer.errors import ArtifactError


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(70, 96, dtype=torch.bfloat16),
        "b": torch.randn(70),
        "q": torch.randint(-127, 127, (33, 5), dtype=torch.int8),
        "f8": torch.randn(8, 16).to(torch.float8_e4m3fn),
        "t": torch.randn(96, 70).t(),  # non-contiguous source
        "s": torch.tensor(3.5),  # 0-d
        "e": torch.empty(0, 4),
    }


def _assert_same(packed: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert sorted(packed) == sorted(state)
    for k, t in state.items():
        p = packed[k]
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bit-exact, fp8 too


def test_packed_tensors_equal_the_originals_and_live_in_one_block():
    state = _state()
    packed = pack_weights(state.items(), capacity=sum(t.numel() * t.element_size() + ALIGN for t in state.values()))
    _assert_same(packed, state)
    starts = sorted(p.data_ptr() for p in packed.values() if p.numel())
    assert all((a - starts[0]) % ALIGN == 0 for a in starts)  # page-aligned offsets in one mapping
    assert starts[-1] - starts[0] < sum(t.numel() * t.element_size() + ALIGN for t in state.values())


def test_packed_tensors_keep_the_block_alive_and_are_independent_copies():
    src = torch.arange(10, dtype=torch.float32)
    a = pack_weights([("a", src)], capacity=ALIGN)["a"]  # no handle to the mapping survives but the tensor
    src.zero_()
    assert torch.equal(a, torch.arange(10, dtype=torch.float32))
    a.add_(1)  # writable, private memory
    assert a[0].item() == 1.0


def test_a_capacity_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="overflows"):
        pack_weights([("a", torch.zeros(1024)), ("b", torch.zeros(1024))], capacity=ALIGN + 100)


def test_read_packed_reads_a_weights_file_and_refuses_a_truncated_one(tmp_path):
    state = {k: t.contiguous() for k, t in _state().items()}
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    _assert_same(read_packed(path), state)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ArtifactError, match="cannot read weights .*recompile"):
        read_packed(path)
