"""Shared fixtures: tiny checkpoints written once per session; torch kept to the machine's 2 cores."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """preset name -> path of a tiny random-weight HF checkpoint (written lazily, once per session)."""
    from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = write_tiny_checkpoint(root / name, **TINY_PRESETS[name])
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _restore_neuron_env():
    """Loading a neuron artifact sets NEURON_LOGICAL_NC_CONFIG to its compiled LNC (as the runtime must start with
    it); restore both Neuron target variables after every test so no test sees another's."""
    names = ("NEURON_LOGICAL_NC_CONFIG", "NEURON_PLATFORM_TARGET_OVERRIDE")
    saved = {n: os.environ.get(n) for n in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
