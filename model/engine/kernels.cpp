// Decode Lab's matrix products for the shared inference model on a CPU (model/engine/kernels.py builds this file
// once per machine, plain C++ and OpenMP, no torch headers): y = x · Wᵀ, x (rows, K) and W (outputs, K) packed in blocks of 16 outputs.
//
// Layout: block b holds outputs 16b .. 16b + 15 of every input k, k after k: float32 and int8 as (blocks, K, 16);
// bfloat16 as (blocks, ⌈K/2⌉, 16, 2), the two inputs 2p and 2p + 1 of an output side by side, as the CPU's bf16
// dot product (vdpbf16ps) reads them. One output's weights are 16 values apart: the tied embedding reads a row there.
//
// Order of the sums: every output of every row is summed over k = 0, 1, ..., K − 1 in turn, in runs of SPAN inputs
// whose sums are added in turn, in float32, whatever the number of rows, the tile that computes it or the thread that
// runs it. So a row comes
// out with the same bits beside any other rows (a batched decode step gives each row its solo run's logits), and
// the outputs of matrices stacked along the outputs (fused QKV, gate/up) are those of each matrix alone.

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int LANES = 16;   // outputs in a block
constexpr int ROWS = 6;     // rows of x in a full tile: 6 × 4 accumulators and 4 weight vectors fill 28 of the
constexpr int BLOCKS = 4;   // 32 AVX-512 registers; one row reads 4 streams of weights at once
constexpr int SPAN = 64;    // inputs summed in one run before the run's sum joins the total: float32 rounding grows
                            // with a run's length, so runs of 64 err about as little as oneDNN's and MKL's sums

static inline f32x16 lanes(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
#if defined(__AVX512F__)  // (GCC 12 turns the generic conversion below into 16 scalar ones)
static inline f32x16 lanes(const int8_t* p) {
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
static inline f32x16 lanes(const int8_t* p) { i8x16 q; std::memcpy(&q, p, sizeof q); return __builtin_convertvector(q, f32x16); }
#endif
static inline f32x16 as_f32(u32x16 bits) { f32x16 v; std::memcpy(&v, &bits, sizeof v); return v; }
static inline float bf16_value(uint16_t bits) { uint32_t w = uint32_t(bits) << 16; float v; std::memcpy(&v, &w, 4); return v; }

// float32 or int8 weights: sum[r][j] = Σ_k x[r][k] · W[j][k], k in turn within each span of SPAN inputs, the spans'
// sums added in turn; int8 outputs times their scales last
template <typename W, int R, int J>
static void tile(const float* x, int64_t ldx, const W* w, int64_t K, const float* scale, float* y, int64_t ldy) {
  f32x16 sum[R][J] = {};
  for (int64_t k0 = 0; k0 < K; k0 += SPAN) {
    const int64_t k1 = std::min(K, k0 + SPAN);
    f32x16 acc[R][J] = {};
    for (int64_t k = k0; k < k1; ++k) {
      f32x16 wk[J];
      for (int j = 0; j < J; ++j) wk[j] = lanes(w + (j * K + k) * LANES);
      for (int r = 0; r < R; ++r) {
        const float xk = x[r * ldx + k];
        for (int j = 0; j < J; ++j) acc[r][j] += xk * wk[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sum[r][j] += acc[r][j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      f32x16 out = sum[r][j];
      if (scale != nullptr) out *= lanes(scale + j * LANES);
      std::memcpy(y + r * ldy + j * LANES, &out, sizeof out);
    }
}

// bfloat16 inputs and weights, float32 sums: per pair, acc += x[2p+1]·W[2p+1], then acc += x[2p]·W[2p] (each product
// of two bfloat16 numbers is exact in float32), the order vdpbf16ps adds them in; spans as above; the output rounded
// to bfloat16
template <int R, int J>
static void tile_bf16(const uint16_t* x, int64_t ldx, const uint32_t* w, int64_t K, uint16_t* y, int64_t ldy) {
  const int64_t pairs = K / 2, P = (K + 1) / 2;
  f32x16 sum[R][J] = {};
  for (int64_t p0 = 0; p0 < pairs; p0 += SPAN / 2) {
    const int64_t p1 = std::min(pairs, p0 + SPAN / 2);
    f32x16 acc[R][J] = {};
    for (int64_t p = p0; p < p1; ++p) {
      u32x16 wk[J];
      for (int j = 0; j < J; ++j) std::memcpy(&wk[j], w + (j * P + p) * LANES, sizeof wk[j]);
      for (int r = 0; r < R; ++r) {
        uint32_t xp;
        std::memcpy(&xp, x + r * ldx + 2 * p, 4);
        for (int j = 0; j < J; ++j) {
#if defined(__AVX512BF16__)
          acc[r][j] = (f32x16)_mm512_dpbf16_ps((__m512)acc[r][j], (__m512bh)_mm512_set1_epi32(int(xp)), (__m512bh)wk[j]);
#else
          acc[r][j] += bf16_value(uint16_t(xp >> 16)) * as_f32(wk[j] & 0xFFFF0000u);
          acc[r][j] += bf16_value(uint16_t(xp)) * as_f32(wk[j] << 16);
#endif
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sum[r][j] += acc[r][j];
  }
  if (K % 2) {  // the last input alone, its pair's second weight zero
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) {
        u32x16 wk;
        std::memcpy(&wk, w + (j * P + pairs) * LANES, sizeof wk);
        sum[r][j] += bf16_value(x[r * ldx + K - 1]) * as_f32(wk << 16);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      // rounded to nearest even, as torch rounds float32 to bfloat16 (a NaN becomes torch's 0x7FC0)
      uint32_t bits[LANES];
      std::memcpy(bits, &sum[r][j], sizeof bits);
      for (int l = 0; l < LANES; ++l)
        y[r * ldy + j * LANES + l] = (bits[l] & 0x7FFFFFFFu) > 0x7F800000u
            ? uint16_t(0x7FC0) : uint16_t((bits[l] + 0x7FFFu + ((bits[l] >> 16) & 1u)) >> 16);
    }
}

// One product over every row and block: the blocks in groups of BLOCKS, shared among `threads` threads; within a
// group, the rows ROWS at a time (a group's weights stay in the cache while its rows pass)
template <typename Tile>
static void each_tile(int64_t rows, int64_t nblocks, int threads, const Tile& run) {
  const int64_t groups = (nblocks + BLOCKS - 1) / BLOCKS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b0 = g * BLOCKS;
    const bool full = b0 + BLOCKS <= nblocks;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
      const int64_t n = std::min<int64_t>(ROWS, rows - r0);
      if (full && n == ROWS) {
        run.template operator()<ROWS, BLOCKS>(r0, b0);
        continue;
      }
      for (int64_t r = r0; r < r0 + n; ++r) {  // the rest a row, or a row and a block, at a time: the same sums
        if (full) run.template operator()<1, BLOCKS>(r, b0);
        else for (int64_t b = b0; b < nblocks; ++b) run.template operator()<1, 1>(r, b);
      }
    }
  }
}

template <typename W>
struct Product {
  const float* x; int64_t K; const W* w; const float* scale; float* y; int64_t ldy;
  template <int R, int J>
  void operator()(int64_t r, int64_t b) const {
    tile<W, R, J>(x + r * K, K, w + b * K * LANES, K, scale ? scale + b * LANES : nullptr, y + r * ldy + b * LANES, ldy);
  }
};

struct ProductBf16 {
  const uint16_t* x; int64_t K; const uint32_t* w; uint16_t* y; int64_t ldy;
  template <int R, int J>
  void operator()(int64_t r, int64_t b) const {
    tile_bf16<R, J>(x + r * K, K, w + b * ((K + 1) / 2) * LANES, K, y + r * ldy + b * LANES, ldy);
  }
};

// The products, called from Python (ctypes) on contiguous tensors: x (rows, K); w packed as above, `blocks` blocks;
// y (rows, 16 · blocks), written whole
extern "C" {

// float32 x and weights -> float32 y
void matmul_f32(const float* x, int64_t rows, int64_t K, const float* w, int64_t blocks, float* y, int threads) {
  each_tile(rows, blocks, threads, Product<float>{x, K, w, nullptr, y, blocks * LANES});
}

// float32 x, int8 weights and one float32 scale per output -> float32 y
void matmul_int8(const float* x, int64_t rows, int64_t K, const int8_t* w, const float* scale, int64_t blocks,
                 float* y, int threads) {
  each_tile(rows, blocks, threads, Product<int8_t>{x, K, w, scale, y, blocks * LANES});
}

// bfloat16 x and weights -> bfloat16 y
void matmul_bf16(const uint16_t* x, int64_t rows, int64_t K, const uint32_t* w, int64_t blocks, uint16_t* y,
                 int threads) {
  each_tile(rows, blocks, threads, ProductBf16{x, K, w, y, blocks * LANES});
}

// whether the bf16 product runs on the CPU's own bf16 dot product (AVX-512 BF16), else float32 multiply-adds
int bf16_instructions() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

}
