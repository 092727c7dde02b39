"""The real signatures of every Neuron SDK function neuron-infer calls (or its doubles stand in for), written from
the SDK's public sources and docs. The recording doubles (tests/compile/neuron_doubles.py,
tests/parallel/test_neuron_tp.py) bind every call against this table: an unknown keyword, a missing required
argument or a positional argument too many fails the test, and the defaults the doubles see are the real ones.

Each entry is a stub with the real parameter names, defaults and kinds, and the source it was read from:
  [trace.rst]   aws-neuron/aws-neuron-sdk frameworks/torch/torch-neuronx/api-reference-guide/inference/
                api-torch-neuronx-trace.rst
                https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.html
  [replace.rst] same folder, api-torch-neuronx-replace-weights.rst
  [nxd]         aws-neuron/neuronx-distributed src/neuronx_distributed/<path> (the function named)
  [nxdi]        aws-neuron/neuronx-distributed-inference src/neuronx_distributed_inference/<path>
  [nki]         aws-neuron/aws-neuron-sdk nki/api/nki/__init__.py (the NKI API reference stubs)
torch-neuronx's own Python source is not public; where its docs give no signature the entry says which public
caller it was read from.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    stub: Callable
    source: str

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.stub)


# --- torch-neuronx ---------------------------------------------------------------------------------------------

def _trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,  # noqa: B006
           partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False): ...


def _replace_weights(neuron_model, weights): ...


def _move_trace_to_device(trace, device_id): ...


def _get_platform_target(): ...


# --- neuronx-distributed ---------------------------------------------------------------------------------------

def _parallel_model_trace(func, example_inputs, states=None, compiler_workdir=None, compiler_args=None,
                          inline_weights_to_neff=True, bucket_config=None, tp_degree=1,
                          max_parallel_compilations=None, spmd_mode=False, checkpoint_loader_callable=None,
                          force_custom_init_on_device=False, serialization_path=None): ...


def _parallel_model_save(model, save_dir): ...


def _parallel_model_load(model_dir): ...


def _model_builder_init(self, router, tp_degree, checkpoint_loader, start_rank_id=0, pp_degree=1, ep_degree=1,
                        local_ranks_size=None, world_size=None, compiler_workdir=None, master_proc_env_vars=None,
                        debug=False, num_cores_per_group=1, init_custom_process_group_fn=None, logical_nc_config=1,
                        weights_to_skip_layout_optimization=set(), compiler_flag_hook=None): ...  # noqa: B006


def _model_builder_add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None,
                       priority_model_idx=None): ...


def _model_builder_trace(self, initialize_model_weights=True, dry_run=False, disable_fail_fast=False): ...


def _model_builder_shard_checkpoint(self, serialize_path=None): ...


def _base_model_instance_init(self, module_cls, input_output_aliases): ...


def _base_model_instance_get(self, bucket_rank, **kwargs): ...


def _nxd_model_initialize(self, checkpoint, start_rank_tensor): ...


def _get_tensor_model_parallel_rank(): ...


def _initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                               expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1,
                               mesh_only=False): ...


def _reduce_from_tp_region(input_, process_group=None): ...


def _gather_from_tp_region(input_, process_group=None): ...


# --- nki ---------------------------------------------------------------------------------------------------------

def _nki_jit(fn=None, **kwargs): ...


_TRACE_RST = "[trace.rst]"
SIGNATURES: dict[str, Entry] = {
    "torch_neuronx.trace": Entry(_trace, f"{_TRACE_RST} py:function torch_neuronx.trace"),
    "torch_neuronx.replace_weights": Entry(_replace_weights, "[replace.rst] py:function torch_neuronx.replace_weights"),
    "torch_neuronx.move_trace_to_device": Entry(_move_trace_to_device,
                                                f"{_TRACE_RST} py:function torch_neuronx.move_trace_to_device"),
    "torch_neuronx.utils.get_platform_target": Entry(
        _get_platform_target, "no docs signature; [nxdi] models/config.py NeuronConfig._setup_kernel_target_platform "
        "and [nxd] utils/model_utils.py get_platform_lnc call it with no arguments"),
    "neuronx_distributed.trace.parallel_model_trace": Entry(_parallel_model_trace,
                                                            "[nxd] trace/trace.py parallel_model_trace"),
    "neuronx_distributed.trace.parallel_model_save": Entry(_parallel_model_save,
                                                           "[nxd] trace/trace.py parallel_model_save"),
    "neuronx_distributed.trace.parallel_model_load": Entry(_parallel_model_load,
                                                           "[nxd] trace/trace.py parallel_model_load"),
    "neuronx_distributed.trace.model_builder.ModelBuilder": Entry(
        _model_builder_init, "[nxd] trace/model_builder.py ModelBuilder.__init__ (the builder NxDI's "
        "models/application_base.py get_builder uses)"),
    "neuronx_distributed.trace.model_builder.ModelBuilder.add": Entry(_model_builder_add,
                                                                      "[nxd] trace/model_builder.py ModelBuilder.add"),
    "neuronx_distributed.trace.model_builder.ModelBuilder.trace": Entry(
        _model_builder_trace, "[nxd] trace/model_builder.py ModelBuilder.trace"),
    "neuronx_distributed.trace.model_builder.ModelBuilder.shard_checkpoint": Entry(
        _model_builder_shard_checkpoint, "[nxd] trace/model_builder.py ModelBuilder.shard_checkpoint"),
    "neuronx_distributed.trace.model_builder.BaseModelInstance": Entry(
        _base_model_instance_init, "[nxd] trace/model_builder.py BaseModelInstance.__init__"),
    "neuronx_distributed.trace.model_builder.BaseModelInstance.get": Entry(
        _base_model_instance_get, "[nxd] trace/model_builder.py BaseModelInstance.get"),
    "neuronx_distributed.trace.spmd.NxDModel.initialize": Entry(
        _nxd_model_initialize, "[nxd] trace/spmd.py NxDModel.initialize (called as traced.nxd_model.initialize "
        "by [nxdi] models/application_base.py load_weights)"),
    "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_rank": Entry(
        _get_tensor_model_parallel_rank, "[nxd] parallel_layers/parallel_state.py get_tensor_model_parallel_rank"),
    "neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel": Entry(
        _initialize_model_parallel, "[nxd] parallel_layers/parallel_state.py initialize_model_parallel"),
    "neuronx_distributed.parallel_layers.mappings.reduce_from_tensor_model_parallel_region": Entry(
        _reduce_from_tp_region, "[nxd] parallel_layers/mappings.py reduce_from_tensor_model_parallel_region"),
    "neuronx_distributed.parallel_layers.mappings.gather_from_tensor_model_parallel_region": Entry(
        _gather_from_tp_region, "[nxd] parallel_layers/mappings.py gather_from_tensor_model_parallel_region"),
    "nki.jit": Entry(_nki_jit, "[nki] jit"),
}


class SDKContractError(AssertionError):
    """A call the real SDK would reject (TypeError at the call site)."""


def bind(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Check one call against the real signature; return every parameter's value, defaults applied."""
    entry = SIGNATURES[name]
    try:
        bound = entry.signature.bind(*args, **kwargs)
    except TypeError as e:
        raise SDKContractError(f"{name}{entry.signature} rejects this call ({e}); source: {entry.source}") from e
    bound.apply_defaults()
    return dict(bound.arguments)


def checked(name: str, impl: Callable[..., Any], method: bool = False) -> Callable[..., Any]:
    """Wrap a double's implementation: the call is bound against the real signature first, then `impl` receives
    the bound arguments as keywords (so it sees the real defaults). `method`: the stub's first parameter is self."""

    def call(*args: Any, **kwargs: Any) -> Any:
        values = bind(name, *((None,) if method else ()), *args, **kwargs)
        values.pop("self", None)
        values.pop("_", None)
        extra = values.pop("kwargs", {})
        return impl(**values, **extra)

    call.__name__ = name.rsplit(".", 1)[-1]
    return call
