"""Fixtures shared by the tests that run a real vLLM (their modules skip when vLLM is absent)."""
import pytest

from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.vllm.vllm_helpers import TINY_VLLM


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint with a head_dim vLLM's CPU attention supports (read-only: plugins compile elsewhere)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", **TINY_VLLM)
