"""Causal masking of an attention score matrix with GpSimd affine_select (NKI documentation)."""
import nki
import nki.isa as nisa
import nki.language as nl

FP32_MIN = -3.4028234663852886e38   # most negative finite fp32; nki.language defines no such constant


@nki.jit
def causal_mask_kernel(scores_hbm):
    """out[q, k] = scores[q, k] if q >= k else FP32_MIN.

    Dimensions: Sq rows (query positions, tiled by 128 on partitions), Sk columns (key positions, tiles of 512).
    Args: scores_hbm [Sq, Sk] fp32/bf16, HBM.
    Returns: out_hbm [Sq, Sk], shared_hbm.
    Notes: tiles entirely above the diagonal are filled with memset; tiles entirely below it are copied.
    Pseudocode: per (q0, k0) tile: affine_select(pattern=[[-1, nk]], channel_multiplier=1, offset=q0-k0, >=).
    """
    sq, sk = scores_hbm.shape
    out_hbm = nl.ndarray((sq, sk), dtype=scores_hbm.dtype, buffer=nl.shared_hbm)
    for qt in nl.affine_range((sq + 127) // 128):
        q0, q1 = qt * 128, min(sq, (qt + 1) * 128)
        for kt in nl.affine_range((sk + 511) // 512):
            k0, k1 = kt * 512, min(sk, (kt + 1) * 512)
            s_sbuf = nl.ndarray((q1 - q0, k1 - k0), dtype=scores_hbm.dtype, buffer=nl.sbuf)
            o_sbuf = nl.ndarray((q1 - q0, k1 - k0), dtype=scores_hbm.dtype, buffer=nl.sbuf)
            if k0 > q1 - 1:
                nisa.memset(dst=o_sbuf, value=FP32_MIN)
            else:
                nisa.dma_copy(dst=s_sbuf, src=scores_hbm[q0:q1, k0:k1])
                if k1 - 1 <= q0:
                    nisa.tensor_copy(dst=o_sbuf, src=s_sbuf)
                else:
                    nisa.affine_select(dst=o_sbuf, pattern=[[-1, k1 - k0]], channel_multiplier=1,
                                       on_true_tile=s_sbuf, on_false_value=FP32_MIN,
                                       cmp_op=nl.greater_equal, offset=q0 - k0)
            nisa.dma_copy(dst=out_hbm[q0:q1, k0:k1], src=o_sbuf)
    return out_hbm
