// Decode Lab's matrix products for the shared inference model on a CPU (model/engine/kernels.py builds this file
// once per machine, plain C++ and OpenMP, no torch headers): y = x · Wᵀ, x (rows, K) and W (outputs, K).
//
// Layout: W's outputs in blocks of 16 (the last one filled up with zeros), the blocks in panels of 4 (64 outputs; the
// last panel may hold fewer). Within a panel the weights go input by input, and for each input the panel's 64
// outputs side by side, so one row streams the panel's weights once, front to back. float32: per input k, 64 numbers;
// bfloat16 and int8: per pair of inputs (2p, 2p + 1), each output's two side by side, as the CPU's bf16 dot product
// (vdpbf16ps) and its int16 dot product (vpdpwssd) read them.
// One output's weights are at a fixed stride there: the tied embedding looks its rows up in them.
//
// Order of the sums: float32 and bfloat16 sum every output of every row over k = 0, 1, ..., K − 1 in turn, in runs of
// SPAN inputs whose sums are added in turn, in float32, whatever the number of rows, the tile that computes it or the
// thread that runs it; int8 sums whole numbers, exactly, in runs of SPAN_INT inputs whose sums join a float32 total in
// turn. Either way a row comes out with
// the same bits beside any other rows (a batched decode step gives each row its solo run's logits), and the outputs
// of matrices stacked along the outputs (fused QKV, gate/up) are those of each matrix alone.
//
// int8 multiplies int8 weights (one float32 scale per output) by the row's inputs rounded to int16 with one scale per
// row, max|x| / 32767, so that the products are whole numbers; nothing from another row enters a row's numbers.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int LANES = 16;   // outputs in a block
constexpr int BLOCKS = 4;   // blocks in a panel: one row reads 4 weight vectors per input
constexpr int ROWS = 6;     // rows of x in a full tile: 6 × 4 accumulators and 4 weight vectors fill 28 of the 32
                            // AVX-512 registers
constexpr int SPAN = 64;    // inputs summed in one run before the run's sum joins the total: float32 rounding grows
                            // with a run's length, so runs of 64 err about as little as oneDNN's and MKL's sums
constexpr int SPAN_INT = 256;  // int8's runs of whole numbers: 256 · 32767 · 127 < 2³¹

// 16 numbers from / to memory at any alignment, one vector load or store (a std::memcpy of a vector was compiled as
// a loop of two 32-byte copies to the stack and a 64-byte load back: a store-forwarding stall in every step of the
// products' inner loop, which held the 6-row tile to about a third of the core's multiply-adds)
typedef float f32x16_any __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t u32x16_any __attribute__((vector_size(64), aligned(4), may_alias));
static inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16_any*>(p); }
static inline u32x16 load16(const uint32_t* p) { return *reinterpret_cast<const u32x16_any*>(p); }
static inline void store16(float* p, f32x16 v) { *reinterpret_cast<f32x16_any*>(p) = v; }

static inline f32x16 as_f32(u32x16 bits) { f32x16 v; std::memcpy(&v, &bits, sizeof v); return v; }
static inline float bf16_value(uint16_t bits) { uint32_t w = uint32_t(bits) << 16; float v; std::memcpy(&v, &w, 4); return v; }

// Where the kernels' time goes, per calling thread (a Streamlit session steps its engine on its own thread): seconds
// in the products, in attention and in the small ops (norms, RoPE, SiLU), summed as they return; op_seconds reads
// them. A clock read costs ~20 ns against a product's tens of µs.
enum OpClass { PRODUCTS = 0, ATTENTION = 1, SMALL_OPS = 2 };
static thread_local double op_totals[3] = {0.0, 0.0, 0.0};
struct Clocked {
  OpClass op;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  explicit Clocked(OpClass c) : op(c) {}
  ~Clocked() { op_totals[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
};

// v as it is, rounded: the compiler may not fuse it into a multiply-add with what follows (torch rounds a product,
// then the sum it joins; one fused multiply-add would round once)
template <typename T> static inline T rounded(T v) {
  volatile T kept = v;
  return kept;
}

// y = out, or residual + out (a residual add: the same bits as torch's x + out)
static inline void store(float* y, f32x16 out, const float* residual) {
  if (residual) {
    out = load16(residual) + out;
  }
  store16(y, out);
}

// float32: sum[r][j] += x[r][k] · W[j][k]; w points at block 0 of the tile, ldw numbers from one input to the next.
// ahead (or null): K cache lines from there are asked into L2 (one a step of k) while the tile computes, a part of the
// next panel: a decode step's few rows then read the next panel from memory while they multiply this one (the panel's
// later tiles read it from L2 and left the memory idle: at 16 rows the products took the time of the reads plus that
// of the multiply-adds)
template <int R, int J>
static void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                     const float* residual, const char* ahead = nullptr) {
  f32x16 sum[R][J] = {};
  for (int64_t k0 = 0; k0 < K; k0 += SPAN) {
    const int64_t k1 = std::min(K, k0 + SPAN);
    f32x16 acc[R][J] = {};
    for (int64_t k = k0; k < k1; ++k) {
      if (ahead) __builtin_prefetch(ahead + k * 64, 0, 2);
      f32x16 wk[J];
      for (int j = 0; j < J; ++j) wk[j] = load16(w + k * ldw + j * LANES);
      for (int r = 0; r < R; ++r) {
        const float xk = x[r * ldx + k];
        for (int j = 0; j < J; ++j) acc[r][j] += xk * wk[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sum[r][j] += acc[r][j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) store(y + r * ldy + j * LANES, sum[r][j], residual ? residual + r * ldy + j * LANES : nullptr);
}

// bfloat16 inputs and weights, float32 sums: per pair, acc += x[2p+1]·W[2p+1], then acc += x[2p]·W[2p] (each product
// of two bfloat16 numbers is exact in float32), the order vdpbf16ps adds them in; spans as above; the outputs
// rounded to bfloat16. ldw: 32-bit words (pairs) from one pair of inputs to the next
template <int R, int J>
static void tile_bf16(const uint16_t* x, int64_t ldx, const uint32_t* w, int64_t ldw, int64_t K, uint16_t* y,
                      int64_t ldy) {
  const int64_t pairs = K / 2;
  f32x16 sum[R][J] = {};
  for (int64_t p0 = 0; p0 < pairs; p0 += SPAN / 2) {
    const int64_t p1 = std::min(pairs, p0 + SPAN / 2);
    f32x16 acc[R][J] = {};
    for (int64_t p = p0; p < p1; ++p) {
      u32x16 wk[J];
      for (int j = 0; j < J; ++j) wk[j] = load16(w + p * ldw + j * LANES);
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
        const u32x16 wk = load16(w + pairs * ldw + j * LANES);
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

// float32 inputs, bfloat16 weights (the bfloat16 layout, pairs side by side), float32 sums: each weight widened to
// the float32 number it is (exactly), then the float32 tile's multiply-adds in its order, k = 0, 1, ..., K − 1 in
// runs of SPAN, so a row's sums are those of tile_f32 over the same weights as float32; a decode step reads half the
// bytes. ahead: as tile_f32's, one cache line a pair of inputs
template <int R, int J, int LINES>
static void tile_bf16w(const float* x, int64_t ldx, const uint32_t* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                       const float* residual, const char* ahead) {
  const int64_t pairs = (K + 1) / 2;  // an odd K's last pair holds one input, its second weight zero
  f32x16 sum[R][J] = {};
  for (int64_t p0 = 0; p0 < pairs; p0 += SPAN / 2) {
    const int64_t p1 = std::min(pairs, p0 + SPAN / 2);
    f32x16 acc[R][J] = {};
    for (int64_t p = p0; p < p1; ++p) {
      if (ahead)
        for (int l = 0; l < LINES; ++l) __builtin_prefetch(ahead + (p * LINES + l) * 64, 0, 2);
      // the pair's first inputs, then its second: 4 weight vectors live beside the 24 sums, as in tile_f32 (the 8 of
      // both halves at once spilled registers: half the speed at 64 rows)
      f32x16 wk[J];
      for (int j = 0; j < J; ++j) wk[j] = as_f32(load16(w + p * ldw + j * LANES) << 16);
      for (int r = 0; r < R; ++r) {
        const float xk = x[r * ldx + 2 * p];
        for (int j = 0; j < J; ++j) acc[r][j] += xk * wk[j];
      }
      if (2 * p + 1 < K) {
        for (int j = 0; j < J; ++j) wk[j] = as_f32(load16(w + p * ldw + j * LANES) & 0xFFFF0000u);
        for (int r = 0; r < R; ++r) {
          const float xk = x[r * ldx + 2 * p + 1];
          for (int j = 0; j < J; ++j) acc[r][j] += xk * wk[j];
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sum[r][j] += acc[r][j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) store(y + r * ldy + j * LANES, sum[r][j], residual ? residual + r * ldy + j * LANES : nullptr);
}

// int8: each row's inputs as int16 (q = round(x · 32767 / max|x|), one scale per row), the weights int8: per pair of
// inputs acc += q[2p]·W[2p] + q[2p+1]·W[2p+1] in int32 (vpdpwssd), whole numbers, exact; every SPAN_INT inputs the
// run's whole sum joins the float32 total (runs short enough that 32767 · 127 · SPAN_INT fits in int32), in turn;
// the total scaled back by the row's scale and the output's. ldw: bytes from one pair of inputs to the next
template <int R, int J>
static void tile_int8(const int16_t* q, int64_t ldq, const int8_t* w, int64_t ldw, int64_t K, const float* sx,
                      const float* scale, float* y, int64_t ldy, const float* residual) {
  const int64_t pairs = (K + 1) / 2;  // q is filled up with a 0 to an even length
  f32x16 sum[R][J] = {};
  for (int64_t p0 = 0; p0 < pairs; p0 += SPAN_INT / 2) {
    const int64_t p1 = std::min(pairs, p0 + SPAN_INT / 2);
    i32x16 acc[R][J] = {};
    for (int64_t p = p0; p < p1; ++p) {
#if defined(__AVX512VNNI__)
      __m512i wk[J];
      for (int j = 0; j < J; ++j)
        wk[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * ldw + j * 2 * LANES)));
#else
      int8_t wk[J][2 * LANES];
      for (int j = 0; j < J; ++j) std::memcpy(wk[j], w + p * ldw + j * 2 * LANES, sizeof wk[j]);
#endif
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, q + r * ldq + 2 * p, 4);
        for (int j = 0; j < J; ++j) {
#if defined(__AVX512VNNI__)
          acc[r][j] = (i32x16)_mm512_dpwssd_epi32((__m512i)acc[r][j], _mm512_set1_epi32(two), wk[j]);
#else
          const int32_t x0 = int16_t(two & 0xFFFF), x1 = int16_t(uint32_t(two) >> 16);
          for (int l = 0; l < LANES; ++l) acc[r][j][l] += x0 * wk[j][2 * l] + x1 * wk[j][2 * l + 1];
#endif
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sum[r][j] += __builtin_convertvector(acc[r][j], f32x16);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      const f32x16 scales = load16(scale + j * LANES);
      store(y + r * ldy + j * LANES, rounded(sum[r][j] * sx[r] * scales), residual ? residual + r * ldy + j * LANES : nullptr);
    }
}

// R rows from row r over panel g: the whole panel in one tile, or a short last panel a block at a time
template <int R, typename Tile>
static inline void panel_rows(const Tile& tile, int64_t r, int64_t g, int64_t in_panel) {
  if (in_panel == BLOCKS) tile.template operator()<R, BLOCKS>(r, g, 0, in_panel);
  else for (int64_t j = 0; j < in_panel; ++j) tile.template operator()<R, 1>(r, g, j, in_panel);
}

// Every tile of one product: the panels shared among `threads` threads; within a panel the rows ROWS at a time (the
// panel's weights stay in the cache while its rows pass), the last rows < ROWS in one tile of their number (each row's
// sums are the same whatever R: a tile of 4 rows reads the panel once where 4 tiles of one row read it 4 times, which
// at a batched decode's 1-5 rows left over cost about as much as the 6-row tiles), and a short last panel a block at a
// time (the same sums in the same order). tile(R, J, row, panel, block) runs one tile.
template <typename Tile>
static void each_tile(int64_t rows, int64_t blocks, int threads, const Tile& tile) {
  const int64_t panels = (blocks + BLOCKS - 1) / BLOCKS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < panels; ++g) {
    const int64_t in_panel = std::min<int64_t>(BLOCKS, blocks - g * BLOCKS);
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
      switch (std::min<int64_t>(ROWS, rows - r0)) {
        case 6: panel_rows<6>(tile, r0, g, in_panel); break;
        case 5: panel_rows<5>(tile, r0, g, in_panel); break;
        case 4: panel_rows<4>(tile, r0, g, in_panel); break;
        case 3: panel_rows<3>(tile, r0, g, in_panel); break;
        case 2: panel_rows<2>(tile, r0, g, in_panel); break;
        default: panel_rows<1>(tile, r0, g, in_panel); break;
      }
    }
  }
}

// The start of panel g: every panel before it is full, BLOCKS blocks of `per_block` numbers each
struct Panels {
  int64_t per_block;  // numbers of one block: 16 × the inputs (rounded up to the pair or the four)
  int64_t start(int64_t g) const { return g * BLOCKS * per_block; }
};

extern "C" {

// The products, called from Python (ctypes) on contiguous tensors: x (rows, K); w packed as above, `blocks` blocks;
// y (rows, 16 · blocks), written whole; float32 y may start from a residual of its shape (null: none), y = residual +
// x · Wᵀ, and may be the residual itself

// float32 x and weights -> float32 y
void matmul_f32(const float* x, int64_t rows, int64_t K, const float* w, int64_t blocks, float* y,
                const float* residual, int threads) {
  const Clocked clocked(PRODUCTS);
  const Panels panels{K * LANES};
  const int64_t ldy = blocks * LANES;
  const int64_t n_panels = (blocks + BLOCKS - 1) / BLOCKS;
  each_tile(rows, blocks, threads, [&]<int R, int J>(int64_t r, int64_t g, int64_t j, int64_t in_panel) {
    const int64_t at = r * ldy + (g * BLOCKS + j) * LANES;
    // the tile's part of the next panel: the panel's i-th row tile asks for its i-th K lines; not at one row, whose
    // tile streams the panels anyway (it measured slower with)
    const int64_t part = (r / ROWS) * K * LANES, next = std::min<int64_t>(BLOCKS, blocks - (g + 1) * BLOCKS) * K * LANES;
    const bool fetch = rows > 1 && J == BLOCKS && g + 1 < n_panels && part < next;
    tile_f32<R, J>(x + r * K, K, w + panels.start(g) + j * LANES, in_panel * LANES, K, y + at, ldy,
                   residual ? residual + at : nullptr,
                   fetch ? reinterpret_cast<const char*>(w + panels.start(g + 1) + part) : nullptr);
  });
}

// bfloat16 x and weights -> bfloat16 y
void matmul_bf16(const uint16_t* x, int64_t rows, int64_t K, const uint32_t* w, int64_t blocks, uint16_t* y,
                 int threads) {
  const Clocked clocked(PRODUCTS);
  const int64_t pairs = (K + 1) / 2;
  const Panels panels{pairs * LANES};  // in 32-bit words, one per output and pair
  const int64_t ldy = blocks * LANES;
  each_tile(rows, blocks, threads, [&]<int R, int J>(int64_t r, int64_t g, int64_t j, int64_t in_panel) {
    tile_bf16<R, J>(x + r * K, K, w + panels.start(g) + j * LANES, in_panel * LANES, K,
                    y + r * ldy + (g * BLOCKS + j) * LANES, ldy);
  });
}

// float32 x, bfloat16 weights -> float32 y (residual as matmul_f32's): matmul_f32's sums over the weights widened
void matmul_bf16w(const float* x, int64_t rows, int64_t K, const uint32_t* w, int64_t blocks, float* y,
                  const float* residual, int threads) {
  const Clocked clocked(PRODUCTS);
  const int64_t pairs = (K + 1) / 2;
  const Panels panels{pairs * LANES};  // in 32-bit words, one per output and pair
  const int64_t ldy = blocks * LANES;
  const int64_t n_panels = (blocks + BLOCKS - 1) / BLOCKS;
  // the next panel's lines asked for while this one's row tiles multiply, shared among them (4 lines a pair of inputs
  // is the whole panel): at one row the weights then stream at the float32 product's rate, about twice as slow
  // without
  const int row_tiles = int((rows + ROWS - 1) / ROWS), lines = (4 + row_tiles - 1) / row_tiles;
  each_tile(rows, blocks, threads, [&]<int R, int J>(int64_t r, int64_t g, int64_t j, int64_t in_panel) {
    const int64_t at = r * ldy + (g * BLOCKS + j) * LANES;
    const int64_t part = (r / ROWS) * lines * pairs;  // in lines of 64 bytes
    const int64_t in_next = std::min<int64_t>(BLOCKS, blocks - (g + 1) * BLOCKS) * pairs;  // a line a block a pair
    const bool fetch = J == BLOCKS && g + 1 < n_panels && part < in_next;
    const float* in = x + r * K;
    const uint32_t* from = w + panels.start(g) + j * LANES;
    const float* add = residual ? residual + at : nullptr;
    const char* ahead = fetch ? reinterpret_cast<const char*>(w + panels.start(g + 1)) + part * 64 : nullptr;
    if (lines == 4) tile_bf16w<R, J, 4>(in, K, from, in_panel * LANES, K, y + at, ldy, add, ahead);
    else if (lines == 2) tile_bf16w<R, J, 2>(in, K, from, in_panel * LANES, K, y + at, ldy, add, ahead);
    else tile_bf16w<R, J, 1>(in, K, from, in_panel * LANES, K, y + at, ldy, add, ahead);
  });
}

// float32 x, int8 weights with a float32 scale per output -> float32 y. Each row is turned into int16 first:
// q = round(x · 32767 / max|x|), its scale max|x| / 32767 (0 for a row of zeros)
void matmul_int8(const float* x, int64_t rows, int64_t K, const int8_t* w, const float* scale, int64_t blocks,
                 float* y, const float* residual, int threads) {
  const Clocked clocked(PRODUCTS);
  const int64_t pairs = (K + 1) / 2;
  std::vector<int16_t> q(rows * pairs * 2, 0);
  std::vector<float> sx(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float most = 0.0f;
    for (int64_t k = 0; k < K; ++k) most = std::max(most, std::fabs(x[r * K + k]));
    const float to_int = most > 0.0f ? 32767.0f / most : 0.0f;
    sx[r] = most / 32767.0f;
    for (int64_t k = 0; k < K; ++k) q[r * pairs * 2 + k] = int16_t(std::nearbyint(x[r * K + k] * to_int));
  }
  const Panels panels{pairs * 2 * LANES};  // in bytes, two per output and pair
  const int64_t ldy = blocks * LANES;
  each_tile(rows, blocks, threads, [&]<int R, int J>(int64_t r, int64_t g, int64_t j, int64_t in_panel) {
    const int64_t first = (g * BLOCKS + j) * LANES;  // the tile's first output
    tile_int8<R, J>(q.data() + r * pairs * 2, pairs * 2, w + panels.start(g) + j * 2 * LANES, in_panel * 2 * LANES,
                    K, sx.data() + r, scale + first, y + r * ldy + first, ldy,
                    residual ? residual + r * ldy + first : nullptr);
  });
}

// The sum of a vector's 16 numbers as a tree, halves added lane by lane (a fixed order, and 4 steps where one by one
// would be 15 in a row)
static inline float lanes_sum(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                     __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// RMSNorm of each row of x (rows, n), float32: y = (x · s) · g, s = 1 / √(Σ x² / n + eps), g = w, or 1 + w
// (Gemma's). A row's sum of squares runs over k in LANES running sums (k mod LANES), which are then added as a tree
// (lanes_sum), the last n mod LANES squares after them: the same bits for a row whatever rows are beside it
void rms_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps, int plus_one, float* y) {
  const Clocked clocked(SMALL_OPS);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    f32x16 lanes = {};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES) {
      const f32x16 v = load16(row + k);
      lanes += v * v;
    }
    float sum = lanes_sum(lanes);
    for (; k < n; ++k) sum += row[k] * row[k];
    const float s = 1.0f / std::sqrt(sum / float(n) + eps);
    for (k = 0; k < n; ++k) y[r * n + k] = (row[k] * s) * (plus_one ? 1.0f + w[k] : w[k]);
  }
}

// e^x of 16 numbers at a time: Cephes' expf (a degree-6 polynomial after taking out the power of two), within a
// couple of units in the last place of std::exp; a number's bits do not depend on the lane it lies in
static inline f32x16 exp16(f32x16 x) {
  x = x > 88.3f ? 88.3f : x;  // e^x stays within float32's normal numbers (a NaN stays NaN)
  x = x < -87.3f ? -87.3f : x;
  const f32x16 magic = f32x16{} + 12582912.0f;  // 1.5 · 2²³: adding it rounds to a whole number
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 e = p * (r * r) + r + 1.0f;
  const i32x16 two_n = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &two_n, sizeof scale);
  return e * scale;
}

// Scores w[0 .. S) into attention weights, in place: e^(w_s − most) 16 at a time (exp16; the last S mod 16 in the
// same vector code, filled up), summed in LANES running sums (s mod LANES) added as a tree (lanes_sum), the last S
// mod 16 after them, then each divided by the sum. The same bits wherever the keys lie and whatever rows are beside
// them; every attention of the kernels weighs its keys here
static inline void softmax_in_place(float* w, int64_t S, float most) {
  f32x16 lanes = {};
  int64_t s = 0;
  for (; s + LANES <= S; s += LANES) {
    const f32x16 e = exp16(load16(w + s) - most);
    store16(w + s, e);
    lanes += e;
  }
  float total = lanes_sum(lanes);
  if (s < S) {
    f32x16 e = {};
    std::memcpy(&e, w + s, (S - s) * sizeof(float));
    e = exp16(e - most);
    std::memcpy(w + s, &e, (S - s) * sizeof(float));
    for (int64_t i = 0; i < S - s; ++i) total += e[i];
  }
  s = 0;
  for (; s + LANES <= S; s += LANES) store16(w + s, load16(w + s) / total);
  for (; s < S; ++s) w[s] /= total;
}

// Attention of one new query per row over that row's S keys, float32 (a decode step): q (B, heads, d) at strides
// q_b, q_h; k and v (B, kv heads, S, d) at strides kv_b, kv_h, kv_s (views into a cache's buffers, never copied); query
// head h reads kv head h / (heads / kv heads). Per head: score_s = (q · k_s) / scale, each dot product in LANES
// running sums then added as a tree (lanes_sum); weight_s = exp(score_s − max) / Σ exp(...) (softmax_in_place);
// out = Σ_s weight_s · v_s in turn. out (B, heads · d), weights (B, heads, S). The same bits for a row whatever rows
// are beside it
static inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 lanes = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const f32x16 x = load16(a + i), y = load16(b + i);
    lanes += x * y;
  }
  float sum = lanes_sum(lanes);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

extern "C++" {  // templates, within the extern "C" block
// Key s + AHEAD's numbers and value s's asked into L2 while key s's score is computed: a query's keys and values lie
// in memory, block by block, and one stream of dependent reads left the core waiting on them (attention took twice
// the time of its reads); the values are read again only after every score, from L2 then
constexpr int64_t AHEAD = 8;
template <typename At>
static inline void fetch_ahead(const float* kh, const float* vh, int64_t s, int64_t S, const At& at, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    if (s + AHEAD < S) __builtin_prefetch(kh + at(s + AHEAD) + i, 0, 2);
    __builtin_prefetch(vh + at(s) + i, 0, 2);
  }
}

// One query head over S keys and values, key and value s at kh + at(s) and vh + at(s): out (d), weights (S). Where
// they lie changes no sum: a cache's contiguous buffer (attend_head) and a paged pool read through a block table
// (attend_paged) give the same bits
template <typename At>
static void attend_head_at(const float* qh, const float* kh, const float* vh, int64_t S, const At& at, int64_t d,
                           float scale, float* o, float* w) {
  float most = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    fetch_ahead(kh, vh, s, S, at, d);
    w[s] = dot(qh, kh + at(s), d) / scale;
    most = std::max(most, w[s]);
  }
  softmax_in_place(w, S, most);
  int64_t i0 = 0;
  for (; i0 + BLOCKS * LANES <= d; i0 += BLOCKS * LANES) {  // 64 outputs at a time in registers
    f32x16 sum[BLOCKS] = {};
    for (int64_t s = 0; s < S; ++s) {
      const float* vs = vh + at(s) + i0;
      for (int j = 0; j < BLOCKS; ++j) sum[j] += w[s] * load16(vs + j * LANES);
    }
    for (int j = 0; j < BLOCKS; ++j) store16(o + i0 + j * LANES, sum[j]);
  }
  std::fill(o + i0, o + d, 0.0f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = i0; i < d; ++i) o[i] += w[s] * vh[at(s) + i];
}
// The G query heads that read one kv head, over the same S keys and values at kh + at(s), vh + at(s): each head's
// numbers exactly as attend_head_at computes that head alone (the same operations in the same order, head by head),
// but each key and value read once for the G heads and the G heads' sums side by side, independent chains whose
// latencies overlap (alone, one head's dot product is a chain of d / 16 multiply-adds and its weighted sum of S).
// q: head g at q + g · q_h; out: head g at o + g · d; w: G × S scratch
template <int G, typename At>
static void attend_group_at(const float* q, int64_t q_h, const float* kh, const float* vh, int64_t S, const At& at,
                            int64_t d, float scale, float* o, float* w) {
  float most[G];
  for (int g = 0; g < G; ++g) most[g] = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    fetch_ahead(kh, vh, s, S, at, d);
    const float* ks = kh + at(s);
    f32x16 lanes[G] = {};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) {
      const f32x16 y = load16(ks + i);
      for (int g = 0; g < G; ++g) lanes[g] += load16(q + g * q_h + i) * y;
    }
    for (int g = 0; g < G; ++g) {
      float sum = lanes_sum(lanes[g]);
      for (int64_t r = i; r < d; ++r) sum += q[g * q_h + r] * ks[r];
      w[g * S + s] = sum / scale;
      most[g] = std::max(most[g], w[g * S + s]);
    }
  }
  for (int g = 0; g < G; ++g) softmax_in_place(w + g * S, S, most[g]);
  int64_t i0 = 0;
  for (; i0 + BLOCKS * LANES <= d; i0 += BLOCKS * LANES) {
    f32x16 sum[G][BLOCKS] = {};
    for (int64_t s = 0; s < S; ++s) {
      const float* vs = vh + at(s) + i0;
      f32x16 vv[BLOCKS];
      for (int j = 0; j < BLOCKS; ++j) vv[j] = load16(vs + j * LANES);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < BLOCKS; ++j) sum[g][j] += w[g * S + s] * vv[j];
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < BLOCKS; ++j) store16(o + g * d + i0 + j * LANES, sum[g][j]);
  }
  for (int g = 0; g < G; ++g) {
    float* og = o + g * d;
    std::fill(og + i0, og + d, 0.0f);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t i = i0; i < d; ++i) og[i] += w[g * S + s] * vh[at(s) + i];
  }
}
}  // extern "C++"

// One query head over S keys and values at stride kv_s: out (d), weights (S)
static void attend_head(const float* qh, const float* kh, const float* vh, int64_t S, int64_t kv_s, int64_t d,
                        float scale, float* o, float* w) {
  attend_head_at(qh, kh, vh, S, [kv_s](int64_t s) { return s * kv_s; }, d, scale, o, w);
}

// Every head of rows 0 .. B − 1, row b over keys first[b] .. end[b] − 1 (first null: all S) -> out (B, heads · d),
// weights (B, heads, S), 0 outside a row's keys
static void attend_rows(const float* q, int64_t B, int64_t heads, int64_t d, int64_t q_b, int64_t q_h, const float* k,
                        const float* v, int64_t kv_heads, int64_t S, int64_t kv_b, int64_t kv_h, int64_t kv_s,
                        const int64_t* first, const int64_t* end, float scale, float* out, float* weights) {
  const Clocked clocked(ATTENTION);
  const int64_t groups = heads / kv_heads;
  if (first) std::fill(weights, weights + B * heads * S, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t from = first ? first[b] : 0, to = first ? end[b] : S;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = b * kv_b + (h / groups) * kv_h + from * kv_s;
      attend_head(q + b * q_b + h * q_h, k + at, v + at, to - from, kv_s, d, scale, out + (b * heads + h) * d,
                  weights + (b * heads + h) * S + from);
    }
  }
}

void attend_one(const float* q, int64_t B, int64_t heads, int64_t d, int64_t q_b, int64_t q_h, const float* k,
                const float* v, int64_t kv_heads, int64_t S, int64_t kv_b, int64_t kv_h, int64_t kv_s, float scale,
                float* out, float* weights) {
  attend_rows(q, B, heads, d, q_b, q_h, k, v, kv_heads, S, kv_b, kv_h, kv_s, nullptr, nullptr, scale, out, weights);
}

// Attention of T queries per row (a prefill, a prompt's chunk), query t over keys first[t] .. end[t] − 1 of its
// row (its causal span, a sliding window's), each query as attend_head does a decode step's: a position's output has
// the same bits whichever pass computes it, whatever the number of queries or keys beside it and on every CPU that
// runs this code (the order of every sum is this code's, not a library's blocking). q (B, heads, T, d) at strides
// q_b, q_h, q_t; k and v (B, kv heads, S, d) at strides kv_b, kv_h, kv_s -> out (B, T, heads · d), weights (B,
// heads, T, S), 0 outside a query's keys
void attend_spans(const float* q, int64_t B, int64_t heads, int64_t T, int64_t d, int64_t q_b, int64_t q_h,
                  int64_t q_t, const float* k, const float* v, int64_t kv_heads, int64_t S, int64_t kv_b, int64_t kv_h,
                  int64_t kv_s, const int64_t* first, const int64_t* end, float scale, float* out, float* weights,
                  int threads) {
  const Clocked clocked(ATTENTION);
  const int64_t groups = heads / kv_heads;
#pragma omp parallel for collapse(3) schedule(dynamic, 8) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < T; ++t) {
        float* w = weights + ((b * heads + h) * T + t) * S;
        std::fill(w, w + first[t], 0.0f);
        std::fill(w + end[t], w + S, 0.0f);
        const int64_t at = b * kv_b + (h / groups) * kv_h + first[t] * kv_s;
        attend_head(q + b * q_b + h * q_h + t * q_t, k + at, v + at, end[t] - first[t], kv_s, d, scale,
                    out + ((b * T + t) * heads + h) * d, w + first[t]);
      }
}

// Attention of a flattened pass's N queries (model/serving/paged.py: prompt chunks and decode rows side by side), each
// over its own request's keys read in place through its block table, no copy: query t (q at strides q_h per head, q_t
// per query) reads positions first[t] .. end[t] − 1 of table row[t]; tables holds rows of `width` block ids, position
// p in block tables[row · width + p / block_size] at offset p % block_size; k and v are one layer's stores (kv heads,
// n_blocks, block_size, d), contiguous. Each query head as attend_head attends it over a contiguous copy of the same
// keys (attend_one's decode step, attend_spans' prefill): the same bits; the query heads of one kv head together
// (attend_group_at). out (N, heads · d)
void attend_paged(const float* q, int64_t N, int64_t heads, int64_t d, int64_t q_h, int64_t q_t, const float* k,
                  const float* v, int64_t kv_heads, int64_t n_blocks, int64_t block_size, const int64_t* tables,
                  int64_t width, const int64_t* row, const int64_t* first, const int64_t* end, float scale, float* out,
                  int threads) {
  const Clocked clocked(ATTENTION);
  const int64_t groups = heads / kv_heads, kv_h = n_blocks * block_size * d, block = block_size * d;
  int64_t longest = 1;
  for (int64_t t = 0; t < N; ++t) longest = std::max(longest, end[t] - first[t]);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> w(std::min<int64_t>(groups, 4) * longest);
    std::vector<int64_t> where(longest);  // the query's keys' offsets in a store, found once for all its heads
#pragma omp for schedule(dynamic, 2)
    for (int64_t t = 0; t < N; ++t) {
      const int64_t* table = tables + row[t] * width;
      const int64_t from = first[t], S = end[t] - from;
      for (int64_t s = 0, p = from; s < S; ++s, ++p) where[s] = table[p / block_size] * block + (p % block_size) * d;
      const int64_t* offsets = where.data();
      const auto at = [offsets](int64_t s) { return offsets[s]; };
      for (int64_t g = 0; g < kv_heads; ++g) {  // the query heads g · groups .. (g + 1) · groups − 1 of kv head g
        const int64_t kv = g * kv_h, h = g * groups;
        const float* qg = q + h * q_h + t * q_t;
        float* og = out + (t * heads + h) * d;
        switch (groups) {
          case 1: attend_group_at<1>(qg, q_h, k + kv, v + kv, S, at, d, scale, og, w.data()); break;
          case 2: attend_group_at<2>(qg, q_h, k + kv, v + kv, S, at, d, scale, og, w.data()); break;
          case 3: attend_group_at<3>(qg, q_h, k + kv, v + kv, S, at, d, scale, og, w.data()); break;
          case 4: attend_group_at<4>(qg, q_h, k + kv, v + kv, S, at, d, scale, og, w.data()); break;
          default:
            for (int64_t i = 0; i < groups; ++i)
              attend_head_at(qg + i * q_h, k + kv, v + kv, S, at, d, scale, og + i * d, w.data());
        }
      }
    }
  }
}

// SiLU(gate) · up of each row of gate_up (rows, 2I at row stride ld: gate, then up), into y (rows, I): gate / (1 +
// exp(−gate)) · up, exp16 16 numbers at a time; the last I mod 16 go through the same vector code, filled up with
// zeros, so every number gets the same bits wherever it lies: a row beside any others, a decode step's row and a
// prefill's (the shared model's MLP, llama.MLP)
static inline f32x16 silu_times(f32x16 gate, f32x16 up) { return gate / (1.0f + exp16(-gate)) * up; }

void silu_mul(const float* gate_up, int64_t rows, int64_t I, int64_t ld, float* y) {
  const Clocked clocked(SMALL_OPS);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * ld;
    const float* up = gate + I;
    float* out = y + r * I;
    int64_t i = 0;
    for (; i + LANES <= I; i += LANES) {
      store16(out + i, silu_times(load16(gate + i), load16(up + i)));
    }
    if (i < I) {
      f32x16 g = {}, u = {};
      std::memcpy(&g, gate + i, (I - i) * sizeof(float));
      std::memcpy(&u, up + i, (I - i) * sizeof(float));
      const f32x16 o = silu_times(g, u);
      std::memcpy(out + i, &o, (I - i) * sizeof(float));
    }
  }
}

// A decode step's layer of a Llama block (model/engine/llama.py, Block.decode) as two calls instead of some twenty
// small torch ops: the same functions in the same order as the block's own ops (llama.Block.forward on the shared
// model), so the same bits.
//   decode_in:  normed = norm_in(x); qkv = normed · Wqkvᵀ; RoPE on the q and k heads of each row
//   (the caller writes k and v into its cache)
//   decode_out: attended = attention over each row's keys; h = x + attended · Woᵀ;
//               out = h + silu_mul(norm_out(h) · Wguᵀ) · Wdownᵀ

// One product's packed weights (kind 0: float32, 1: int8 with a scale per output, 2: bfloat16)
struct Matrix {
  const void* w;
  const float* scale;
  int64_t blocks;
  int64_t kind;
};

struct Layer {
  const float* norm_in;
  const float* norm_out;
  Matrix qkv, o, gate_up, down;
  int64_t hidden, intermediate, heads, kv_heads, d_head, plus_one;
  float eps, scale;
};

static void product(const Matrix& m, const float* x, int64_t rows, int64_t K, float* y, const float* residual,
                    int threads) {
  if (m.kind == 1)
    matmul_int8(x, rows, K, static_cast<const int8_t*>(m.w), m.scale, m.blocks, y, residual, threads);
  else if (m.kind == 2)
    matmul_bf16w(x, rows, K, static_cast<const uint32_t*>(m.w), m.blocks, y, residual, threads);
  else
    matmul_f32(x, rows, K, static_cast<const float*>(m.w), m.blocks, y, residual, threads);
}

// x·cos + turned(x)·sin for each of `heads` heads of d numbers (turned: the halves swapped, sin's first half
// negated: llama.apply_rope), rounded as torch rounds those ops
static void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  std::vector<float> head(d);
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    std::copy(xh, xh + d, head.begin());
    for (int64_t i = 0; i < d; ++i) xh[i] = rounded(head[i] * cos[i]) + rounded(head[(i + half) % d] * sin[i]);
  }
}

// x (rows, hidden); cos and sin (rows, d_head) at row stride cs_row (0: one for every row) -> qkv (rows, (heads +
// 2 kv_heads) · d_head), q and k turned
void decode_in(const Layer* L, const float* x, int64_t rows, const float* cos, const float* sin, int64_t cs_row,
               float* qkv, int threads) {
  std::vector<float> normed(rows * L->hidden);
  rms_norm(x, rows, L->hidden, L->norm_in, L->eps, int(L->plus_one), normed.data());
  product(L->qkv, normed.data(), rows, L->hidden, qkv, nullptr, threads);
  const int64_t width = (L->heads + 2 * L->kv_heads) * L->d_head;
  const Clocked clocked(SMALL_OPS);
  for (int64_t r = 0; r < rows; ++r)
    rope(qkv + r * width, L->heads + L->kv_heads, L->d_head, cos + r * cs_row, sin + r * cs_row);
}

// qkv from decode_in; k and v (rows, kv_heads, S, d_head) at strides kv_b, kv_h, kv_s, row r reading keys
// first[r] .. end[r] − 1 -> weights (rows, heads, S), 0 outside a row's keys; out (rows, hidden), the block's output
// The layer after its attention: h = x + attended · Woᵀ; out = h + silu_mul(norm_out(h) · Wguᵀ) · Wdownᵀ
static void layer_rest(const Layer* L, const float* x, int64_t rows, const float* attended, float* out, int threads) {
  std::vector<float> normed(rows * L->hidden), gate_up(rows * 2 * L->intermediate), act(rows * L->intermediate);
  product(L->o, attended, rows, L->heads * L->d_head, out, x, threads);
  rms_norm(out, rows, L->hidden, L->norm_out, L->eps, int(L->plus_one), normed.data());
  product(L->gate_up, normed.data(), rows, L->hidden, gate_up.data(), nullptr, threads);
  silu_mul(gate_up.data(), rows, L->intermediate, 2 * L->intermediate, act.data());
  product(L->down, act.data(), rows, L->intermediate, out, out, threads);
}

void decode_out(const Layer* L, const float* x, int64_t rows, const float* qkv, const float* k, const float* v,
                int64_t kv_b, int64_t kv_h, int64_t kv_s, const int64_t* first, const int64_t* end, int64_t S,
                float* weights, float* out, int threads) {
  const int64_t d = L->d_head, width = (L->heads + 2 * L->kv_heads) * d;
  std::vector<float> attended(rows * L->heads * d);
  attend_rows(qkv, rows, L->heads, d, width, d, k, v, L->kv_heads, S, kv_b, kv_h, kv_s, first, end, L->scale,
              attended.data(), weights);
  layer_rest(L, x, rows, attended.data(), out, threads);
}

// A layer of a flattened pass over a paged pool (llama.Block.pass_in_place) in one call: decode_in on the pass's N
// positions as rows, their new keys and values copied into the layer's stores k and v (kv heads, n_blocks,
// block_size, d) at block blocks[t], offset offsets[t], then each query attended as attend_paged attends it, through
// the tables, and the rest of the layer as decode_out has it; no attention weights. The same functions in the same
// order as when decode_in, the pool's write, attend_paged and the rest of the layer were called one by one from
// Python (some ten small torch and Python ops a layer: 2-3 ms of a 25 ms one-row SmolLM2 pass): the same bits
void layer_paged(const Layer* L, const float* x, int64_t rows, const float* cos, const float* sin, int64_t cs_row,
                 float* k, float* v, const int64_t* blocks, const int64_t* offsets, int64_t n_blocks,
                 int64_t block_size, const int64_t* tables, int64_t width, const int64_t* row, const int64_t* first,
                 const int64_t* end, float* out, int threads) {
  const int64_t d = L->d_head, kv_heads = L->kv_heads, stride = (L->heads + 2 * kv_heads) * d;
  std::vector<float> qkv(rows * stride), attended(rows * L->heads * d);
  decode_in(L, x, rows, cos, sin, cs_row, qkv.data(), threads);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = ((h * n_blocks + blocks[t]) * block_size + offsets[t]) * d;
      const float* heads = qkv.data() + t * stride + (L->heads + h) * d;  // its key head, then kv_heads on its value
      std::copy(heads, heads + d, k + at);
      std::copy(heads + kv_heads * d, heads + (kv_heads + 1) * d, v + at);
    }
  attend_paged(qkv.data(), rows, L->heads, d, d, stride, k, v, kv_heads, n_blocks, block_size, tables, width, row,
               first, end, L->scale, attended.data(), threads);
  layer_rest(L, x, rows, attended.data(), out, threads);
}

// this thread's seconds so far in the products, attention and the small ops (OpClass order) -> out[0..2]
void op_seconds(double* out) { std::copy(op_totals, op_totals + 3, out); }

// whether the bfloat16 product runs on the CPU's own bf16 dot product (AVX-512 BF16), else float32 multiply-adds
int bf16_instructions() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// whether the int8 product runs on the CPU's own int16 dot product (AVX-512 VNNI's vpdpwssd), else whole-number
// multiply-adds (the same numbers either way)
int int8_instructions() {
#if defined(__AVX512VNNI__)
  return 1;
#else
  return 0;
#endif
}

}
