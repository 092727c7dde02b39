"""Per-row K/V sequences laid out as a block KV cache, as the model's attention reads them."""
import torch


def as_blocks(k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int = 0):
    """k, v [B, H, S, D] -> (k_cache, v_cache [N, H, bs, D], table [B, S/bs] int64) holding the same positions in
    shuffled blocks, N = B*S/bs + 1: block 0 is the scratch block no row names, filled with NaN, so attention that
    reads a block outside its table shows it."""
    b, h, s, d = k.shape
    w = s // block_size
    assert w * block_size == s, "S must be a multiple of the block size"
    ids = torch.randperm(b * w, generator=torch.Generator().manual_seed(seed)) + 1  # [B*W] block ids 1..N-1
    table = ids.view(b, w)  # [B, W]
    caches = []
    for t in (k, v):
        cache = torch.full((b * w + 1, h, block_size, d), float("nan"), dtype=t.dtype)  # [N, H, bs, D]
        cache[table.reshape(-1)] = t.view(b, h, w, block_size, d).transpose(1, 2).reshape(b * w, h, block_size, d)
        caches.append(cache)
    return caches[0], caches[1], table
