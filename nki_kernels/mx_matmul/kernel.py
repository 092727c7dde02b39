"""MX (microscaling) matmul for NeuronCore-v4 (trn3): y = x @ W with MXFP8 / MXFP4 weights — see design.md.

Dimensions:
    N: tokens (any; blocks of up to 2048 tokens whose MXFP8 activations stay in SBUF, 128-token stationary
    tiles; an odd tile is padded to even).
    K: contraction, a multiple of 512 (= 128 partitions x 4 quad slots; zero-pad K on the host).
    F: output features (any; moving tiles of 512 = one fp32 PSUM bank).  T = K / 512 contraction tiles.

Args:
    x_hbm: [N, K] activations, bf16, HBM (quantized on chip to MXFP8 e4m3fn with quantize_mx).
    w_hbm: [K/4, F] weight words in the quad-packed layout of neuron_infer/quant/mx_golden.py
        (quantize_for_matmul): uint32 = 4 x float8_e4m3fn (MXFP8) or uint16 = 4 x float4_e2m1fn (MXFP4), HBM.
    ws_hbm: [K/32, F] uint8 E8M0 weight scales, logical layout (row t*16 + g covers partitions 8g..8g+7 of
        contraction tile t), HBM.

Returns:
    y_hbm: [N, F] = x @ dequant(W), bf16, shared HBM.

Notes:
    Envelope: gen4 only (quantize_mx, nc_matmul_mx, dma_transpose). Activations are the stationary operand
    ([128 partitions, <= 128 tokens] x4), weights the moving one ([128, 512 outputs] x4), so PSUM already holds
    y[tokens, outputs] (no output transpose). x reaches the quad layout (slot q of word f holds
    k = t*512 + q*128 + p) by one 4-D HBM->SBUF dma_transpose per 128 tokens ([n, T, 4, 128] -> [128, T, 4, n]
    written into the [128, T, n, 4] tile through a permuted view).
    All weight scales come in once with 4 DMAs (one per 32-partition quadrant: logical scale row g lives at
    partition 32*(g//4) + g%4; T*F bytes per partition); weights move in groups of whole 512-output tiles of up
    to 32 KiB per partition per DMA, and outputs leave once per (token tile, group). Every weight tile is reused
    by all token tiles of a token block (up to 2048 tokens, 96 KiB per partition of MXFP8 activations). Precision: quantize_mx uses the NKI >= 0.5 scale rule (no clipping);
    fp32 PSUM accumulation over the T tiles; one bf16 rounding on the way out.

Pseudocode:
    for token block nb (<= 2048 tokens):
      for 128 tokens, t: xq[t], xs[t] = quantize_mx(quad(x[tokens, t*512:(t+1)*512]^T))
      for group of f tiles: W[:, t, group] -> SBUF (all t)            (Ws[:, t, :] loaded once up front)
        for token tile m, f tile in group: y[m, f] = sum_t nc_matmul_mx(xq[t][:, m], W[:, t, f], xs[t][:, m], Ws[:, t, f])
"""
import nki
import nki.isa as nisa
import nki.language as nl

P = 128           # partitions of a contraction tile
QUAD = 4          # slots per x4 word: contraction tile = 512
MAX_TOK_BLOCK = 2048   # tokens per block: every weight tile is loaded once per block
XQ_BUDGET = 96 * 1024  # SBUF bytes per partition for the block's quantized activations and scales
TOK_TILE = 128    # tokens per stationary tile
F_TILE = 512      # outputs per moving tile (one fp32 PSUM bank)
W_DMA_BYTES = 32 * 1024   # per partition per weight DMA: whole F tiles up to this size


def _quantize_block(x_hbm, n0, n1):
    """xq [128, T, tb] float8_e4m3fn_x4 and xs [128, T, tb] scales for tokens [n0, n1) (tb even)."""
    n_t = x_hbm.shape[1] // (P * QUAD)
    rows = n1 - n0
    tb = rows + rows % 2   # nc_matmul_mx needs an even stationary free size
    xq = nl.ndarray((P, n_t, tb), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name="xq")
    xs = nl.ndarray((P, n_t, tb), dtype=nl.float8_e8m0fnu, buffer=nl.sbuf, name="xs")
    for s0 in range(0, rows, TOK_TILE):
        s1 = min(rows, s0 + TOK_TILE)
        sp = s1 - s0 + (s1 - s0) % 2
        quad = nl.ndarray((P, n_t, sp, QUAD), dtype=x_hbm.dtype, buffer=nl.sbuf, name="x_quad")
        if sp > s1 - s0:
            nisa.memset(dst=quad[:, :, s1 - s0:sp, :], value=0.0)
        # x[tokens, (t, q, p)] -> quad[p, t, token, q]: one 4-D DMA transpose per 128 tokens
        src = x_hbm[n0 + s0:n0 + s1, :].reshape((s1 - s0, n_t, QUAD, P))           # [n, T, 4, 128]
        nisa.dma_transpose(dst=quad[:, :, 0:s1 - s0, :].permute((0, 1, 3, 2)), src=src, axes=(3, 1, 2, 0))
        for t in range(n_t):
            nisa.quantize_mx(dst=xq[:, t, s0:s0 + sp], src=quad[:, t, :, :], dst_scale=xs[:, t, s0:s0 + sp])
    return xq, xs


def _token_block(n_t):
    """Tokens whose quantized activations stay resident (<= 96 KiB per partition: 5 B per token per K tile)."""
    fit = (XQ_BUDGET // (n_t * 5)) // TOK_TILE * TOK_TILE
    return max(TOK_TILE, min(MAX_TOK_BLOCK, fit))


def _weight_group(n_t, w_dtype, f_total):
    """Outputs per weight DMA: whole 512-output tiles, up to 32 KiB per partition (fewer fixed DMA costs)."""
    word = 4
    if w_dtype == nl.float4_e2m1fn_x4:
        word = 2
    tiles = max(1, W_DMA_BYTES // (n_t * F_TILE * word))
    return min(tiles * F_TILE, (f_total + F_TILE - 1) // F_TILE * F_TILE)


def _load_weights(w_hbm, f0, f1, w_dtype):
    """Weight words [128, T, f1-f0] (x4 dtype) in the quadrant layout for outputs [f0, f1), one DMA."""
    n_t = w_hbm.shape[0] // P
    w_sbuf = nl.ndarray((P, n_t, f1 - f0), dtype=w_dtype, buffer=nl.sbuf, name="w_tile")
    # [T*128, F] -> [T, 128, F] -> [T, 128, fc] -> [128, T, fc]
    w_view = w_hbm.view(w_dtype).reshape((n_t, P, w_hbm.shape[1]))[:, :, f0:f1].permute((1, 0, 2))
    nisa.dma_copy(dst=w_sbuf, src=w_view)
    return w_sbuf


def _load_scales(ws_hbm, n_t):
    """All weight scales [128, T, F] (E8M0) in the quadrant layout, 4 DMAs for the whole kernel."""
    f_total = ws_hbm.shape[1]
    # partitions outside the 4 scale rows of each quadrant are never read by nc_matmul_mx
    ws_sbuf = nl.ndarray((P, n_t, f_total), dtype=nl.float8_e8m0fnu, buffer=nl.sbuf, name="ws_all")
    groups = P // 8
    s_view = ws_hbm.view(nl.float8_e8m0fnu).reshape((n_t, groups, f_total))   # [T, 16, F]
    for j in range(groups // 4):
        # logical rows g = 4j..4j+3 of every tile -> partitions 32j..32j+3: [T, 4, F] -> [4, T, F]
        nisa.dma_copy(dst=ws_sbuf[32 * j:32 * j + 4, :, :], src=s_view[:, 4 * j:4 * j + 4, :].permute((1, 0, 2)))
    return ws_sbuf


def _token_tile(xq, xs, w_sbuf, ws_sbuf, tiles, y_sbuf):
    """y_sbuf [mp, g1-g0] = x tile @ W[:, g0:g1] (tiles = (m0, mp, g0, g1)), one PSUM bank per 512 outputs."""
    m0, mp, g0, g1 = tiles
    n_t = xq.shape[1]
    for f0 in range(g0, g1, F_TILE):
        f1 = min(g1, f0 + F_TILE)
        acc = nl.ndarray((mp, f1 - f0), dtype=nl.float32, buffer=nl.psum, name="y_psum")
        for t in range(n_t):
            nisa.nc_matmul_mx(dst=acc, stationary=xq[:, t, m0:m0 + mp], moving=w_sbuf[:, t, f0 - g0:f1 - g0],
                              stationary_scale=xs[:, t, m0:m0 + mp], moving_scale=ws_sbuf[:, t, f0:f1],
                              accumulate=(t > 0))
        nisa.tensor_copy(dst=y_sbuf[:, f0 - g0:f1 - g0], src=acc)


@nki.jit
def mx_matmul_kernel(x_hbm, w_hbm, ws_hbm):
    """y = x @ W, W in MXFP8 or MXFP4 (quad-packed words + E8M0 scales); see the module docstring."""
    n_tok, k_total = x_hbm.shape
    f_total = w_hbm.shape[1]
    n_t = k_total // (P * QUAD)
    w_dtype = nl.float8_e4m3fn_x4
    if w_hbm.dtype == nl.uint16:
        w_dtype = nl.float4_e2m1fn_x4
    y_hbm = nl.ndarray((n_tok, f_total), dtype=x_hbm.dtype, buffer=nl.shared_hbm, name="mx_out")
    tok_block = _token_block(n_t)
    ws_sbuf = _load_scales(ws_hbm, n_t)
    group = _weight_group(n_t, w_dtype, f_total)
    for n0 in range(0, n_tok, tok_block):
        n1 = min(n_tok, n0 + tok_block)
        xq, xs = _quantize_block(x_hbm, n0, n1)
        for g0 in range(0, f_total, group):
            g1 = min(f_total, g0 + group)
            w_sbuf = _load_weights(w_hbm, g0, g1, w_dtype)
            for m0 in range(0, n1 - n0, TOK_TILE):
                m1 = min(n1 - n0, m0 + TOK_TILE)
                mp = m1 - m0 + (m1 - m0) % 2
                y_sbuf = nl.ndarray((mp, g1 - g0), dtype=x_hbm.dtype, buffer=nl.sbuf, name="y_rows")
                _token_tile(xq, xs, w_sbuf, ws_sbuf, (m0, mp, g0, g1), y_sbuf)
                nisa.dma_copy(dst=y_hbm[n0 + m0:n0 + m1, g0:g1], src=y_sbuf[0:m1 - m0, :])
    return y_hbm
