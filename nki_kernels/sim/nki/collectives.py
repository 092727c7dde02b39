"""``nki.collectives`` is not implemented by the CPU simulator (like AWS's, the NKI documentation)."""

_NAMES = ("all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
          "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce", "rank_id",
          "ReplicaGroup")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{name} is not implemented in the CPU simulator")

    return _not_implemented
