"""Tensor parallelism: the sharding plan, pure shard/gather functions, the CPU rank launcher and collectives,
and the capacity planner behind `neuron-infer plan`."""
