// Causal attention for any number of query rows per KV head (decode steps, batched steps, speculative verification,
// prefill) over the block KV cache: out[b, h, r] = softmax(q[b, h, r] . k_j / sqrt(D), j <= positions[b, r]) @ v_j,
// where position j of batch row b lives in block table[b, j / bs] at slot j % bs of the caches k, v [N blocks, H,
// bs, D]; q, k, v bf16, every sum in fp32 and the result rounded once to bf16 (round to nearest even). The kernel
// reads the cached keys and values in place through the table: no gathered copy of a row's blocks is made.
//
// Called directly from AOTInductor-generated wrappers (a C shim); see neuron_infer/backends/cpu/kernels.py for the op,
// its PyTorch reference twin and how this file is built.
//
// Why: decode and verify attention read each cached key and value once for all the query rows of a KV head (the
// GQA group's heads times the step's tokens), widen them to fp32 once into a small buffer, and compute a row's 16 (8
// with AVX2) scores as 16 dot products reduced together by one transpose-and-add tree - no horizontal sum per key.
// At head dims of 4 or 8 vectors, tiles of up to 4 query rows share each key's and value's loads (scores, pv), and
// give the FMA units independent chains; a row's operations and their order are those of the row alone (other head
// dims run the same code one row at a time).
//
// Order of work, fixed whatever the number of rows, the batch, the cache bucket or the thread count, so each query
// row's result depends only on its own query and the keys and values it sees: a verify pass over K+1 tokens computes
// bit for bit what K+1 one-token steps compute (docs/cpu-backend.md, "Batch invariance").
// * Keys are split into chunks of kChunk positions from position 0. Per (batch row, KV head, chunk) and query row:
//   the scores of the visible keys of the chunk, their max m, p = exp(s - m), l = the sum of p (lane-wise partial
//   sums over the chunk's key groups in order, then one horizontal sum), o = sum of p_j v_j (key by key in order).
// * Per query row: M = max of the chunks' m; out = (sum of exp(m_c - M) o_c) / (sum of exp(m_c - M) l_c), chunks in
//   order. Keys past a row's position are never read into its sums; a row that sees no key gets zeros.
// The work items (batch row, KV head, chunk, block of kRowBlock query rows that sees part of the chunk) are one
// OpenMP loop; the per-row merge a second loop in the same parallel region. A row's sums do not depend on which
// other rows share its item or tile, so the split changes no result.
#include "cpu_gemv_common.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using ni_gemv::to_bf16;
using ni_gemv::view_nd;

constexpr int64_t kChunk = 128;  // key positions per work item (K and V of a chunk widened: 2 x 32 KB at D = 64)
constexpr int64_t kMaxD = 256;   // head dims up to this, a multiple of 32
constexpr int64_t kMaxRows = 16;  // rows whose PV products a chunk batches (pv)
constexpr int64_t kRowBlock = 64;  // query rows per work item (a prefill's rows spread over the threads)

#ifdef __AVX512F__
struct V {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int64_t kRegisters = 32;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  // 16 bf16 -> 16 fp32 in order (exact)
  static F widen(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // Lanes i >= n set to `fill` (0 <= n <= 16).
  static F keep_first(F v, int64_t n, float fill) {
    const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), v);
  }
  static F floor(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for integral n in [-126, 127]
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
  }
  // a[i] summed: lane i of the result (ni_gemv::sums16: a transpose-and-add tree).
  static F sums(const F (&a)[16]) { return ni_gemv::sums16(a); }
};
#else
struct V {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int64_t kRegisters = 16;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static F widen(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F keep_first(F v, int64_t n, float fill) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, m);
  }
  static F floor(F v) { return _mm256_floor_ps(v); }
  static F pow2(F n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  }
  // a[i] summed: lane i of the result (pairwise horizontal adds, then the two 128-bit halves).
  static F sums(const F (&a)[8]) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    // t0 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], t1 likewise for a4..a7
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
  }
};
#endif
constexpr int64_t L = V::kLanes;

// exp(x) for x <= 0 (scores minus their max), Cephes' single-precision method: x = n ln2 + r with |r| <= ln2 / 2, a
// degree-5 polynomial for exp(r), times 2^n. Relative error ~1e-7; x below -87 is taken as -87 (exp ~1.6e-38).
inline V::F exp_neg(V::F x) {
  x = V::max(x, V::set1(-87.0f));
  const V::F n = V::floor(V::fma(x, V::set1(1.44269504088896341f), V::set1(0.5f)));
  V::F r = V::fma(n, V::set1(-0.693359375f), x);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  V::F p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  p = V::fma(V::mul(p, r), r, V::add(r, V::set1(1.0f)));
  return V::mul(p, V::pow2(n));
}

// The operands: q [B, H, R, D], the caches k and v [N, H, bs, D] (bf16, any strides but a unit one in D), table
// [B, W] int64 (block ids < N; S = W x bs positions per row), positions [B, R] int64; out a new contiguous
// [B, H, R, D] bf16 tensor.
struct Attn {
  int64_t b = 0, h = 0, r = 0, s = 0, d = 0, bs = 0;
  const uint16_t *q = nullptr, *k = nullptr, *v = nullptr;
  const int64_t *pos = nullptr, *tab = nullptr;
  int64_t qs[3] = {}, ks[3] = {}, vs[3] = {}, ps[2] = {}, ts[2] = {};
  uint16_t* out = nullptr;

  // Position j of batch row bi, KV head hi: its key and its value in the caches (its block, then its slot).
  const uint16_t* key(int64_t bi, int64_t hi, int64_t j, const uint16_t** value) const {
    const int64_t blk = tab[bi * ts[0] + j / bs * ts[1]], slot = j % bs;
    *value = v + blk * vs[0] + hi * vs[1] + slot * vs[2];
    return k + blk * ks[0] + hi * ks[1] + slot * ks[2];
  }

  // Keys row `row` of batch row `bi` sees: positions 0..pos (none if pos < 0, all S if pos >= S).
  int64_t visible(int64_t bi, int64_t row) const {
    const int64_t p = pos[bi * ps[0] + row * ps[1]];
    return p < 0 ? 0 : std::min(p + 1, s);
  }
};

// The tiled loops below are instantiated for head dims of ND = 4 or 8 vectors (loops unrolled, vectors in
// registers) and for ND = 0: any head dim, its nd = D / L vectors read at run time, one row per tile.
template <int64_t ND>
constexpr int64_t kVecs = ND > 0 ? ND : kMaxD / L;  // vectors per row an array must hold

// o[r] += p[r][j] v_j for keys j in [j0, j1) of the rows of a tile (their probabilities pr[r], outputs o[r], nd
// vectors each), key by key in order: one load of v_j for every row of the tile, and RT x nd independent FMA chains
// (one row alone is a chain per output vector, bound by the FMA latency). Per row, the same operations in the same
// order whatever the tile.
template <int RT, int64_t ND>
inline void pv_rows(const float* const (&pr)[RT], const float* vf, int64_t j0, int64_t j1, int64_t nd,
                    V::F (&o)[RT][kVecs<ND>]) {
  if constexpr (ND > 0) nd = ND;
  for (int64_t j = j0; j < j1; j++) {
    const float* vj = vf + j * nd * L;
    V::F vv[kVecs<ND>];
    for (int64_t i = 0; i < nd; i++) vv[i] = V::load(vj + i * L);
    for (int r = 0; r < RT; r++) {
      const V::F p = V::set1(pr[r][j]);
      for (int64_t i = 0; i < nd; i++) o[r][i] = V::fma(p, vv[i], o[r][i]);
    }
  }
}

// Rows per PV tile at ND vectors per row: as many as fit next to v_j's ND vectors in the vector registers, up to 4
// (SmolLM2's 3 query heads per KV head make one-token steps tiles of 3).
template <int64_t ND>
constexpr int kTile = ND == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(4, (V::kRegisters - ND - 1) / ND));

// The PV products of RT rows (their probabilities pr[r], keys seen[r], outputs out[r]) of a chunk, n <= RT of them
// (fewer: the instance for n): keys [0, their fewest seen) for all together, then each row's remaining keys alone.
template <int64_t ND, int RT = kTile<ND>>
void pv_tile(const float* const* pr, const int64_t* seen, float* const* out, int64_t n, int64_t nd, const float* vf) {
  if constexpr (RT > 1) {
    if (n < RT) return pv_tile<ND, RT - 1>(pr, seen, out, n, nd, vf);
  }
  if constexpr (ND > 0) nd = ND;
  const float* tp[RT];
  V::F o[RT][kVecs<ND>];
  int64_t common = seen[0];
  for (int r = 0; r < RT; r++) {
    tp[r] = pr[r];
    common = std::min(common, seen[r]);
    for (int64_t i = 0; i < nd; i++) o[r][i] = V::zero();
  }
  pv_rows<RT, ND>(tp, vf, 0, common, nd, o);
  for (int r = 0; r < RT; r++) {
    const float* one[1] = {tp[r]};
    V::F o1[1][kVecs<ND>];
    for (int64_t i = 0; i < nd; i++) o1[0][i] = o[r][i];
    pv_rows<1, ND>(one, vf, common, seen[r], nd, o1);
    for (int64_t i = 0; i < nd; i++) V::store(out[r] + i * L, o1[0][i]);
  }
}

// The PV products of `n` rows of a chunk, kTile<ND> at a time.
template <int64_t ND>
void pv(const float* const* pr, const int64_t* seen, float* const* out, int64_t n, int64_t nd, const float* vf) {
  for (int64_t t = 0; t < n; t += kTile<ND>)
    pv_tile<ND>(pr + t, seen + t, out + t, std::min<int64_t>(kTile<ND>, n - t), nd, vf);
}

// Rows per score tile at ND vectors per row: their queries (RT x ND vectors), one key's ND vectors and RT
// accumulators in the vector registers, up to 4 rows.
template <int64_t ND>
constexpr int kTileQK = ND == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(4, (V::kRegisters - ND) / (ND + 1)));
constexpr int64_t kMaxTile = 4;

// Row `row`'s query vector i, times 1/sqrt(D) in fp32 (as the reference scales it).
inline V::F query(const Attn& a, int64_t bi, int64_t hi, int64_t row, int64_t i, float scale) {
  return V::mul(V::widen(a.q + bi * a.qs[0] + hi * a.qs[1] + row * a.qs[2] + i * L), V::set1(scale));
}

// The raw scores of RT rows against the chunk's keys [0, groups L) (widened in kf, nd vectors per key) into sc[row]:
// per key, one load of its vectors for every row; per (row, key) the same products in the same order as one row
// alone; each row's 16 (AVX2: 8) scores of a group reduced by one transpose-and-add tree.
template <int RT, int64_t ND>
void scores_rows(const V::F (&qv)[RT][kVecs<ND>], const float* kf, int64_t groups, int64_t nd,
                 float* const (&s)[RT]) {
  if constexpr (ND > 0) nd = ND;
  for (int64_t g = 0; g < groups; g++) {
    V::F dots[RT][L];
    for (int64_t j = 0; j < L; j++) {
      const float* kj = kf + (g * L + j) * nd * L;
      V::F kv[kVecs<ND>];
      for (int64_t i = 0; i < nd; i++) kv[i] = V::load(kj + i * L);
      for (int r = 0; r < RT; r++) {
        V::F acc = V::mul(qv[r][0], kv[0]);
        for (int64_t i = 1; i < nd; i++) acc = V::fma(qv[r][i], kv[i], acc);
        dots[r][j] = acc;
      }
    }
    for (int r = 0; r < RT; r++) V::store(s[r] + g * L, V::sums(dots[r]));
  }
}

// The raw scores of the n <= RT rows in `rows` (fewer: the instance for n), together; row r's into sc[r - r0].
template <int64_t ND, int RT = kTileQK<ND>>
void scores(const Attn& a, int64_t bi, int64_t hi, const int64_t* rows, int64_t n, int64_t c0, int64_t r0,
            float scale, const float* kf, float* sc) {
  if constexpr (RT > 1) {
    if (n < RT) return scores<ND, RT - 1>(a, bi, hi, rows, n, c0, r0, scale, kf, sc);
  }
  const int64_t nd = ND > 0 ? ND : a.d / L;
  V::F qv[RT][kVecs<ND>];
  float* s[RT];
  int64_t most = 0;  // key groups of the row that sees the most keys of the chunk
  for (int r = 0; r < RT; r++) {
    for (int64_t i = 0; i < nd; i++) qv[r][i] = query(a, bi, hi, rows[r], i, scale);
    s[r] = sc + (rows[r] - r0) * kChunk;
    most = std::max(most, (std::min(a.visible(bi, rows[r]), c0 + kChunk) - c0 + L - 1) / L);
  }
  scores_rows<RT, ND>(qv, kf, most, nd, s);
}

// One work item: chunk c of KV head (bi, hi) for every query row in [r0, r0 + kRowBlock) that sees part of it.
// Writes, per row, the chunk's max score m, sum of exponentials l and unnormalised output o [D] into part
// ([B][H][R][chunks][D + 2], fp32).
// kf, vf: kChunk x D floats; sc: kRowBlock x kChunk floats (this thread's buffers).
void chunk(const Attn& a, int64_t bi, int64_t hi, int64_t c, int64_t r0, int64_t chunks, float scale, float* kf,
           float* vf, float* sc, float* part) {
  const int64_t d = a.d, c0 = c * kChunk, nd = d / L, r1 = std::min(a.r, r0 + kRowBlock);
  int64_t end = c0;  // keys [c0, end) are seen by some row of the block
  for (int64_t row = r0; row < r1; row++) end = std::max(end, std::min(a.visible(bi, row), c0 + kChunk));
  const int64_t nk = end - c0, groups = (nk + L - 1) / L;
  for (int64_t j = 0; j < groups * L; j++) {  // widen the chunk's keys and values once for all rows (zeros past nk)
    const uint16_t* vj = nullptr;
    const uint16_t* kj = j < nk ? a.key(bi, hi, c0 + j, &vj) : nullptr;
    for (int64_t i = 0; i < nd; i++) {
      V::store(kf + j * d + i * L, kj ? V::widen(kj + i * L) : V::zero());
      V::store(vf + j * d + i * L, kj ? V::widen(vj + i * L) : V::zero());
    }
  }
  // Per row that sees part of the chunk: its scores (tiles of rows share each key's loads), their max, the
  // probabilities (kept in sc for the PV pass) and their sum; then the PV products, kMaxRows rows at a time. ND = 4
  // or 8: the tiled instances; any other head dim: ND = 0.
  int64_t n = 0, seen_of[kMaxRows], tile[kMaxTile], nt = 0;
  const float* prob[kMaxRows];
  float* out_of[kMaxRows];
  const int64_t tile_rows = nd == 4 ? kTileQK<4> : nd == 8 ? kTileQK<8> : kTileQK<0>;
  auto pv_batch = [&]() {
    nd == 4 ? pv<4>(prob, seen_of, out_of, n, nd, vf)
            : nd == 8 ? pv<8>(prob, seen_of, out_of, n, nd, vf) : pv<0>(prob, seen_of, out_of, n, nd, vf);
    n = 0;
  };
  auto finish = [&](int64_t row) {  // scores in sc -> m, probabilities, l; the PV products
    const int64_t seen = std::min(a.visible(bi, row), c0 + kChunk) - c0;
    float* s = sc + (row - r0) * kChunk;
    const int64_t row_groups = (seen + L - 1) / L;
    V::F mv = V::set1(-INFINITY);
    for (int64_t g = 0; g < row_groups; g++) {
      const V::F sg = V::keep_first(V::load(s + g * L), seen - g * L, -INFINITY);
      V::store(s + g * L, sg);
      mv = V::max(mv, sg);
    }
    const float m = V::hmax(mv);
    V::F lv = V::zero();
    for (int64_t g = 0; g < row_groups; g++) {
      const V::F p = V::keep_first(exp_neg(V::sub(V::load(s + g * L), V::set1(m))), seen - g * L, 0.0f);
      V::store(s + g * L, p);
      lv = V::add(lv, p);
    }
    float* out = part + ((((bi * a.h + hi) * a.r + row) * chunks) + c) * (d + 2);
    out[0] = m;
    out[1] = V::hsum(lv);
    prob[n] = s, seen_of[n] = seen, out_of[n] = out + 2;
    if (++n == kMaxRows) pv_batch();
  };
  auto flush = [&]() {  // the scores of the rows in `tile`, then each row's softmax
    nd == 4   ? scores<4>(a, bi, hi, tile, nt, c0, r0, scale, kf, sc)
    : nd == 8 ? scores<8>(a, bi, hi, tile, nt, c0, r0, scale, kf, sc)
              : scores<0>(a, bi, hi, tile, nt, c0, r0, scale, kf, sc);
    for (int64_t t = 0; t < nt; t++) finish(tile[t]);
    nt = 0;
  };
  for (int64_t row = r0; row < r1; row++) {
    if (std::min(a.visible(bi, row), c0 + kChunk) - c0 <= 0) continue;
    tile[nt++] = row;
    if (nt == tile_rows) flush();
  }
  if (nt > 0) flush();
  if (n > 0) pv_batch();
}

// Row `row` of KV head (bi, hi): the chunks' partial results merged, divided by the softmax sum, rounded to bf16.
void merge(const Attn& a, int64_t bi, int64_t hi, int64_t row, int64_t chunks, const float* part) {
  const int64_t d = a.d, n = (a.visible(bi, row) + kChunk - 1) / kChunk;  // chunks the row saw
  uint16_t* y = a.out + ((bi * a.h + hi) * a.r + row) * d;
  if (n == 0) {
    std::memset(y, 0, static_cast<size_t>(d) * sizeof(uint16_t));
    return;
  }
  const float* pr = part + (((bi * a.h + hi) * a.r + row) * chunks) * (d + 2);
  float mx = pr[0];
  for (int64_t c = 1; c < n; c++) mx = std::max(mx, pr[c * (d + 2)]);
  float l = 0.0f, acc[kMaxD];
  for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
  for (int64_t c = 0; c < n; c++) {
    const float* pc = pr + c * (d + 2);
    const float w = std::exp(pc[0] - mx);
    l += w * pc[1];
    for (int64_t i = 0; i < d; i++) acc[i] += w * pc[2 + i];
  }
  for (int64_t i = 0; i < d; i++) y[i] = to_bf16(acc[i] / l);
}

void run(const Attn& a) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  // (bi, hi, c, r0) flattened: every chunk c some row of the block [r0, r0 + kRowBlock) of batch row bi sees
  std::vector<int64_t>& items = ni_gemv::scratch_vector<int64_t>();
  items.clear();
  int64_t chunks = 1;
  for (int64_t bi = 0; bi < a.b; bi++)
    for (int64_t r0 = 0; r0 < a.r; r0 += kRowBlock) {
      int64_t seen = 0;
      for (int64_t row = r0; row < std::min(a.r, r0 + kRowBlock); row++) seen = std::max(seen, a.visible(bi, row));
      chunks = std::max(chunks, (seen + kChunk - 1) / kChunk);
      for (int64_t hi = 0; hi < a.h; hi++)
        for (int64_t c = 0; c * kChunk < seen; c++) items.insert(items.end(), {bi, hi, c, r0});
    }
  // Every (row, chunk) entry merge reads is written by chunk first, and so are the per-thread key/value/score
  // buffers: no zero-filling.
  float* part = ni_gemv::scratch<float, 1>(static_cast<size_t>(a.b * a.h * a.r * chunks * (a.d + 2)));
  const int64_t n_items = static_cast<int64_t>(items.size() / 4), n_rows = a.b * a.h * a.r;
#pragma omp parallel
  {
    float* kf = ni_gemv::scratch<float, 2>(static_cast<size_t>(2 * kChunk * a.d + kRowBlock * kChunk));
    float *vf = kf + kChunk * a.d, *sc = vf + kChunk * a.d;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_items; t++)
      chunk(a, items[4 * t], items[4 * t + 1], items[4 * t + 2], items[4 * t + 3], chunks, scale, kf, vf, sc, part);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_rows; t++) merge(a, t / (a.h * a.r), t / a.r % a.h, t % a.r, chunks, part);
  }
}

}  // namespace

extern "C" {

// q [B, H, R, D], k, v [N, H, bs, D] bf16 (unit stride in D; D a multiple of 32, at most 256), table [B, W] int64
// (every entry a block id < N), positions [B, R] int64 -> *ret0 = new contiguous [B, H, R, D] bf16 tensor.
// AOTI_TORCH_FAILURE on any other input (the generated wrapper turns that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_attn_v2(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                         AtenTensorHandle table, AtenTensorHandle positions, AtenTensorHandle* ret0) {
  const int32_t bf16 = aoti_torch_dtype_bfloat16(), i64 = aoti_torch_dtype_int64();
  int64_t *qsz, *qst, *ksz, *kst, *vsz, *vst, *tsz, *tst, *psz, *pst;
  void *qd, *kd, *vd, *td, *pd;
  if (!view_nd(q, 4, bf16, &qsz, &qst, &qd) || !view_nd(k, 4, bf16, &ksz, &kst, &kd) ||
      !view_nd(v, 4, bf16, &vsz, &vst, &vd) || !view_nd(table, 2, i64, &tsz, &tst, &td) ||
      !view_nd(positions, 2, i64, &psz, &pst, &pd))
    return AOTI_TORCH_FAILURE;
  Attn a;
  a.b = qsz[0], a.h = qsz[1], a.r = qsz[2], a.d = qsz[3], a.bs = ksz[2], a.s = tsz[1] * ksz[2];
  for (int i = 0; i < 4; i++)
    if (vsz[i] != ksz[i]) return AOTI_TORCH_FAILURE;
  if (ksz[1] != a.h || ksz[3] != a.d || a.d % 32 != 0 || a.d > kMaxD || a.r < 1 || a.bs < 1 || tsz[0] != a.b ||
      psz[0] != a.b || psz[1] != a.r)
    return AOTI_TORCH_FAILURE;
  a.q = static_cast<const uint16_t*>(qd), a.k = static_cast<const uint16_t*>(kd);
  a.v = static_cast<const uint16_t*>(vd), a.pos = static_cast<const int64_t*>(pd);
  a.tab = static_cast<const int64_t*>(td);
  for (int64_t bi = 0; bi < a.b; bi++)  // every block the table names must exist
    for (int64_t w = 0; w < tsz[1]; w++) {
      const int64_t id = a.tab[bi * tst[0] + w * tst[1]];
      if (id < 0 || id >= ksz[0]) return AOTI_TORCH_FAILURE;
    }
  for (int i = 0; i < 3; i++) a.qs[i] = qst[i], a.ks[i] = kst[i], a.vs[i] = vst[i];
  a.ps[0] = pst[0], a.ps[1] = pst[1], a.ts[0] = tst[0], a.ts[1] = tst[1];
  const int64_t sizes[4] = {a.b, a.h, a.r, a.d};
  void* od = nullptr;
  if (!ni_gemv::new_bf16_tensor(4, sizes, ret0, &od)) return AOTI_TORCH_FAILURE;
  a.out = static_cast<uint16_t*>(od);
  run(a);
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
