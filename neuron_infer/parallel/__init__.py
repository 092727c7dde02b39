"""Tensor parallelism: the sharding plan, pure shard/gather functions, and the CPU rank launcher and collectives."""
