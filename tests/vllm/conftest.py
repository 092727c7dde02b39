"""Fixtures shared by the tests that start a real vLLM (their modules skip when vLLM is absent)."""
import pytest

from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.vllm.vllm_helpers import TINY_VLLM


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint with a head_dim vLLM's CPU attention supports (read-only: plugins compile elsewhere)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", **TINY_VLLM)


@pytest.fixture(scope="session")
def reference(tiny, tmp_path_factory):
    """neuron-infer's own tp-1 fp32 artifact of `tiny` (eager graphs): the reference the vLLM runs must equal."""
    from neuron_infer.api import CompiledModel, compile_model
    from neuron_infer.config import BuildConfig

    out = tmp_path_factory.mktemp("ref") / "a"
    build = BuildConfig(dtype="fp32", batch_size=1, max_context_length=128, max_length=128)
    compile_model(tiny, out, build, backend="cpu-eager", say=lambda m: None)
    return CompiledModel.load(out)
