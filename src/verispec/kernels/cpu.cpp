// verispec's native CPU kernels: a Llama-family forward pass over a batch of tokens, with weights in
// float32, float16 or the GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, their values
// and scales repacked), and the matrix products, norms and attention it is made of.
//
// The one guarantee everything here keeps: a token's outputs are a function of that token's own inputs
// (its hidden state, its position, the cache slots it may see) and of nothing else in the call. Every
// output element is computed by one thread, in one fixed order that depends on the matrix's shape alone,
// never on how many rows share the call, how they are tiled or how many threads run; activations are
// quantized row by row (one scale per row and block of 32, never per call). So a token scored alone, in a
// block of draft tokens or beside other sequences gets bit-identical logits, which is what makes
// speculative verification with these kernels exact.
//
// Built by verispec.kernels.build on the machine that runs it (-march=native), called through ctypes; the C
// ABI below is all Python sees. Loops are split over threads (parallel_for): OpenMP's, shared with torch,
// in the process's first thread; a pool of the library's own from any other (a server's engine thread).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(VS_PORTABLE)
#define VS_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define VS_AVX512 1  // 512-bit kernels, 16 outputs per group
#endif
#endif


// ------------------------------------------------------------------------------------------ threads

// A pool of worker threads for the loops of a forward called from a thread other than the first. run(n, T,
// body) calls body(i) for every i in [0, n), thread t taking the contiguous share [t n / T, (t + 1) n / T)
// (every output element is computed the same way whoever computes it). Between jobs the workers spin for a
// few milliseconds (yielding the core to any runnable thread), then sleep: a forward runs ~200 short
// parallel sections, and waking a sleeping thread for each costs more than the section — which is what
// OpenMP's libgomp does from a second thread, counting more threads than cores. One caller at a time uses
// the pool; another one meanwhile runs its loop on its own thread.
class Pool {
   public:
    static Pool& get() {
        static Pool pool;
        return pool;
    }

    template <class F>
    void run(int n, int threads, F& body) {
        if (threads > n) threads = n;
        if (threads <= 1 || !call_.try_lock()) {
            for (int i = 0; i < n; i++) body(i);
            return;
        }
        while ((int)workers_.size() < threads - 1) {
            const int index = (int)workers_.size() + 1;
            const long now = generation_.load();  // the job it waits for is the next one
            workers_.emplace_back([this, index, now] { work(index, now); });
        }
        job_ = &invoke<F>;
        context_ = &body;
        n_ = n;
        threads_ = threads;
        pending_.store((int)workers_.size(), std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(sleep_); }
            wake_.notify_all();
        }
        share(0);
        while (pending_.load(std::memory_order_acquire) > 0) pause();
        call_.unlock();
    }

    ~Pool() {
        stop_.store(true);
        generation_.fetch_add(1);
        { std::lock_guard<std::mutex> lock(sleep_); }
        wake_.notify_all();
        for (auto& worker : workers_) worker.join();
    }

   private:
    template <class F>
    static void invoke(void* context, int i) { (*static_cast<F*>(context))(i); }

    static inline void pause() { std::this_thread::yield(); }  // spin, but let a runnable thread have the core

    void share(int t) {
        if (t >= threads_) return;
        const int begin = (int)((long)n_ * t / threads_), end = (int)((long)n_ * (t + 1) / threads_);
        for (int i = begin; i < end; i++) job_(context_, i);
    }

    void work(int index, long seen) {
        while (true) {
            const auto start = std::chrono::steady_clock::now();
            int spins = 0;
            while (generation_.load(std::memory_order_acquire) == seen) {
                pause();
                if (++spins % 1024 == 0 && std::chrono::steady_clock::now() - start > std::chrono::milliseconds(5)) {
                    std::unique_lock<std::mutex> lock(sleep_);
                    sleepers_.fetch_add(1, std::memory_order_seq_cst);
                    wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
                    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
                }
            }
            seen = generation_.load(std::memory_order_acquire);
            if (stop_.load()) return;
            share(index);
            pending_.fetch_sub(1, std::memory_order_release);
        }
    }

    std::mutex call_, sleep_;
    std::condition_variable wake_;
    std::vector<std::thread> workers_;
    std::atomic<long> generation_{0};
    std::atomic<int> pending_{0}, sleepers_{0};
    std::atomic<bool> stop_{false};
    void (*job_)(void*, int) = nullptr;
    void* context_ = nullptr;
    int n_ = 0, threads_ = 1;
};

// Whether the calling thread is the process's first one: there OpenMP shares torch's thread team (the
// libgomp torch loaded), whose threads spin between sections as ours do; from any other thread libgomp
// would start a second team and, counting more threads than cores, stop spinning.
static inline bool first_thread() {
#ifdef __linux__
    static thread_local const bool first = getpid() == (pid_t)syscall(SYS_gettid);
    return first;
#else
    return true;
#endif
}

// body(i) for every i in [0, n) on `threads` threads, each taking a contiguous share
template <class F>
static inline void parallel_for(int n, int threads, F&& body) {
    if (threads > n) threads = n;
    if (threads <= 1) {
        for (int i = 0; i < n; i++) body(i);
    } else if (first_thread()) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int i = 0; i < n; i++) body(i);
    } else {
        Pool::get().run(n, threads, body);
    }
}

enum { VS_F16 = 1, VS_Q8_0 = 2, VS_Q4_1 = 3, VS_Q4_0 = 4, VS_Q5_0 = 5, VS_Q5_1 = 6, VS_Q4_K = 7, VS_Q5_K = 8,
       VS_Q6_K = 9, VS_F32 = 10 };
enum { QK = 32, QK_K = 256 };  // elements per quantization block; per K-quant super-block (8 blocks)

// A weight matrix W [rows, cols], y = x W^T (+ bias). The block formats' layouts are given with the products.
typedef struct {
    int32_t format;        // VS_F16, VS_F32 or a block format (VS_Q8_0 ... VS_Q6_K)
    int32_t rows, cols;    // cols % 32 == 0 for the block formats (% 256 for the K-quants)
    const void* q;         // F16: uint16 [rows, cols]; F32: float [rows, cols]; block formats: their values
    const uint16_t* d;     // float16 scales: per block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), per super-block (K)
    const uint16_t* m;     // float16 minimums: per block (Q4_1, Q5_1); per super-block (Q4_K, Q5_K: dmin)
    const uint8_t* sc;     // K-quants: each block's 6-bit scale (Q4_K, Q5_K), each 16's int8 scale (Q6_K)
    const uint8_t* sm;     // Q4_K, Q5_K: each block's 6-bit minimum
    const float* bias;     // [rows] or NULL
} vs_matrix;

// Matrices of one input whose outputs lie side by side (q, k and v; gate and up), each in its own format.
enum { VS_STACK = 3 };
typedef struct {
    int32_t count;  // 1 .. VS_STACK
    vs_matrix part[VS_STACK];
} vs_stack;

// One decoder layer. The optional parts (NULL: absent; window 0: full attention) give the architectures
// beside Llama's: Qwen3's and Gemma 3's q/k norms, Gemma 3's norms of the attention's and the MLP's outputs
// and its sliding-window layers with their own RoPE.
typedef struct {
    const float* attn_norm;       // [hidden]
    const float* mlp_norm;        // [hidden]
    vs_stack qkv;                 // [(heads + 2 kv_heads) head_dim, hidden]: q, k and v
    vs_matrix o;                  // [hidden, heads head_dim]
    vs_stack gate_up;             // [2 intermediate, hidden]: gate and up
    vs_matrix down;               // [hidden, intermediate]
    const float* q_norm;          // [head_dim]: each query head RMS-normalised before RoPE, or NULL
    const float* k_norm;          // [head_dim]: each key head likewise, or NULL
    const float* post_attn_norm;  // [hidden]: the attention's output normalised before the residual, or NULL
    const float* post_mlp_norm;   // [hidden]: the MLP's output likewise, or NULL
    int32_t window;               // > 0: a token sees the slots of the last `window` positions (its own included)
    int32_t local_rope;           // 1: RoPE from the batch's local tables (cos_local, sin_local)
} vs_layer;

enum { VS_SILU = 0, VS_GELU_TANH = 1 };  // the MLP's activation of the gate
typedef struct {
    int32_t hidden, intermediate, heads, kv_heads, head_dim, num_layers;
    float eps;
    float attn_scale;     // attention scores' scale (1 / sqrt(head_dim) for Llama)
    int32_t activation;   // VS_SILU or VS_GELU_TANH
    const vs_layer* layers;  // [num_layers]
} vs_model;

// N tokens, each of one sequence of the cache. Token i writes its key and value at slot[i] of row seq[i]
// and attends to that row's slots [0, base[i]) and to the new slots base[i] + j with mask[i, j] (no mask:
// every slot from base[i] to slot[i], a causal block).
// A sliding-window layer hides the slots before position pos[i] - window + 1 from token i (committed slots
// are positions; a tree's new slots are all seen while it is shallower than the window).
typedef struct {
    int32_t n;
    const float* cos;        // [N, head_dim / 2]: RoPE at each token's position, as transformers computes it
    const float* sin;        // [N, head_dim / 2]
    const int32_t* seq;      // [N]
    const int32_t* slot;     // [N]
    const int32_t* base;     // [N]
    const uint8_t* mask;     // [N, mask_cols] or NULL
    int32_t mask_cols;
    const int32_t* pos;      // [N]: each token's position (read by sliding-window layers), or NULL
    const float* cos_local;  // [N, head_dim / 2]: RoPE of the local_rope layers, or NULL
    const float* sin_local;  // [N, head_dim / 2]
} vs_batch;

// Keys and values in float16. Keys (after RoPE) in tiles of 16 slots, each tile [head_dim][16] so that one
// vector load holds one dimension of 16 consecutive slots; values slot by slot.
enum { KT = 16 };  // slots per key tile
typedef struct {
    uint16_t* k;  // [layers, batch, kv_heads, capacity / 16, head_dim, 16]
    uint16_t* v;  // [layers, batch, kv_heads, capacity, head_dim]
    int32_t batch, capacity;  // capacity: a multiple of 16
} vs_cache;

// ------------------------------------------------------------------------------------------ float16

static inline float fp16_to_fp32(uint16_t h) {
#ifdef VS_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | (uint32_t)(112 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#ifdef VS_AVX2
static inline float hsum8(__m256 v) {  // fixed order: (lo + hi) then pairwise
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot_f32(const float* a, const float* b, int n) {
    int k = 0;
    float sum = 0.0f;
#ifdef VS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    sum = hsum8(acc);
#endif
    for (; k < n; k++) sum += a[k] * b[k];
    return sum;
}

// ------------------------------------------------------------------------------------------ activations

// Q8 activations of n rows of `cols` values: per row and block of 32, d = max|x| / 127, q = round(x / d)
// (ties to even), sum = the block's sum of q, lo = the sum of its first 16, s = d * sum (what the minimums
// multiply).
typedef struct {
    int8_t* q;     // [n, cols]
    float* d;      // [n, cols / 32]
    float* s;      // [n, cols / 32]
    int32_t* sum;  // [n, cols / 32]
    int32_t* lo;   // [n, cols / 32]
} vs_qrows;

static void quantize_row(const float* x, int cols, int8_t* q, float* d, float* s, int32_t* sums, int32_t* lo) {
#ifdef VS_AVX512
    // the same arithmetic, 16 lanes at a time (see the AVX2 steps below); the narrowing saturates nothing
    for (int b = 0; b < cols / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        const int first = _mm512_reduce_add_epi32(q0), sum = first + _mm512_reduce_add_epi32(q1);
        _mm_storeu_si128((__m128i*)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = scale;
        s[b] = scale * (float)sum;
        sums[b] = sum;
        lo[b] = first;
    }
#elif defined(VS_AVX2)
    // the same arithmetic, 8 lanes at a time: max|x| is exact, x / d rounds to nearest even (the default
    // rounding mode, which nearbyintf follows too), the packing saturates nothing (|q| <= 127)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < cols / QK; b++) {
        const float* xb = x + b * QK;
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        __m256i qi[4];
        for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        const auto hsum = [](__m256i v) {
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
            return _mm_cvtsi128_si32(t);
        };
        const int first = hsum(_mm256_add_epi32(qi[0], qi[1]));
        const int sum = first + hsum(_mm256_add_epi32(qi[2], qi[3]));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i*)(q + b * QK), _mm256_permutevar8x32_epi32(packed, order));
        d[b] = scale;
        s[b] = scale * (float)sum;
        sums[b] = sum;
        lo[b] = first;
    }
#else
    for (int b = 0; b < cols / QK; b++) {
        const float* xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0, first = 0;
        for (int j = 0; j < QK; j++) {
            const int v = (int)nearbyintf(xb[j] * inv);
            q[b * QK + j] = (int8_t)v;
            sum += v;
            if (j < QK / 2) first += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
        sums[b] = sum;
        lo[b] = first;
    }
#endif
}

// The calling thread's scratch buffers, kept from call to call (grown as needed, never shrunk), so that a
// forward's working memory costs no allocation and touches no fresh page after the first calls; NULL when
// out of memory. One buffer per purpose: a caller never holds two uses of the same one.
enum { BUF_X, BUF_WIDE, BUF_ATTN, BUF_PARTS, BUF_QUANT, BUF_DRAFT, BUFFERS };
static void* thread_buffer(int which, size_t bytes) {
    thread_local struct Buffers {
        void* data[BUFFERS] = {};
        size_t capacity[BUFFERS] = {};
        ~Buffers() {
            for (void* p : data) free(p);
        }
    } buffers;
    if (bytes > buffers.capacity[which]) {
        free(buffers.data[which]);
        const size_t size = (bytes + 63) / 64 * 64;
        buffers.data[which] = aligned_alloc(64, size);
        buffers.capacity[which] = buffers.data[which] ? size : 0;
    }
    return buffers.data[which];
}

// x [n, cols] quantized into the thread's buffer; 0, or -2 when out of memory
static int quantize(int n, int cols, const float* x, vs_qrows* qx, int threads) {
    const size_t values = (size_t)n * cols, blocks = values / QK;
    float* floats = (float*)thread_buffer(BUF_QUANT, values + 4 * sizeof(float) * blocks);  // 4-byte arrays first
    if (!floats) return -2;
    qx->d = floats;
    qx->s = floats + blocks;
    qx->sum = (int32_t*)(floats + 2 * blocks);
    qx->lo = (int32_t*)(floats + 3 * blocks);
    qx->q = (int8_t*)(floats + 4 * blocks);
    const int nb = cols / QK;
    parallel_for(n, threads, [&](int r) {
        quantize_row(x + (size_t)r * cols, cols, qx->q + (size_t)r * cols, qx->d + (size_t)r * nb,
                     qx->s + (size_t)r * nb, qx->sum + (size_t)r * nb, qx->lo + (size_t)r * nb);
    });
    return 0;
}

// ------------------------------------------------------------------------------------------ products
// y[r, o] = row o of W . row r of x. Threads split the outputs; each thread takes the activation rows in
// tiles of up to TILE, so that weights, once loaded and unpacked, serve several rows. Tiling only
// interleaves independent computations: every (o, r) pair runs the same sequence of operations whatever the
// tile it lands in (templates unrolled over the tile's size), so y[r, o] is a function of W's row o and x's
// row r alone.
//
// float16 and float32 W are kept row-major, one output at a time, vectorized along the row (two
// accumulators, added at the end). The block formats are kept interleaved: outputs in groups of VS_GROUP,
// a vector lane per output, each lane summing 4 consecutive products of its output at a time against 4
// activation values broadcast to every lane, so that a block's scales multiply whole vectors of outputs.
// Every block format is an unsigned integer u per weight, w = scale (u - offset) + minimum, stored per group
// and block of 32 columns as chunks of VS_GROUP * 4 bytes (byte 4 l + j of a chunk is lane l's):
//   8 bits (Q8_0: u = q + 128): 8 chunks c, byte 4 l + j = u[l][4 c + j];
//   4, 5 and 6 bits: 4 chunks c of nibbles, byte 4 l + j = u[l][4 c + j] & 15 | (u[l][16 + 4 c + j] & 15) << 4,
//   then one chunk per bit above the fourth (bit 4, then bit 5), byte 4 l + j holding that bit of
//   u[l][4 c + j] at bit c and of u[l][16 + 4 c + j] at bit 4 + c, for c = 0 .. 3.
// Scales per group, VS_GROUP values in lane order: float16 per block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and
// Q4_1's and Q5_1's float16 minimums); the K-quants' float16 per super-block of 8 blocks (d; Q4_K's and
// Q5_K's dmin) times an integer per block (u8: Q4_K's and Q5_K's 6-bit scales and minimums, the minimum
// subtracted) or per 16 columns (int8: Q6_K, whose first 16 and last 16 columns of a block sum apart).
// Rows are padded to a multiple of VS_GROUP with zero scales. Block sums are exact integers and a K-quant's
// d times its integer scale is exact in float32; the float steps per block are fixed: acc += (d_w d_x) sum,
// and for formats with minimums a second accumulator of m_w s_x.

enum { TILE = 4 };  // activation rows per float16 tile
#ifdef VS_AVX512
#define GROUP_TILE 8  // activation rows per group tile: 32 vector registers hold 8 rows' accumulators
#else
#define GROUP_TILE 4
#endif

#ifdef VS_AVX512
#define VS_GROUP 16
#else
#define VS_GROUP 8
#endif
enum { CHUNK = VS_GROUP * 4 };
enum { PREFETCH = 2048 };  // bytes ahead in a group's weight stream (and the next group's) to prefetch

// How a block format's scales are kept (see above).
enum { S_BLOCK = 0, S_SUPER = 1, S_HALVES = 2 };

// A block format: BITS per value (its chunks per block: 8, or 4 + the bits above 4), OFFSET subtracted from
// u, SCALES kept as S_*, MIN: whether it has minimums.
template <int BITS_, int OFFSET_, int SCALES_, bool MIN_>
struct Format {
    enum { BITS = BITS_, OFFSET = OFFSET_, SCALES = SCALES_, CHUNKS = BITS_ == 8 ? 8 : BITS_ };
    static constexpr bool MIN = MIN_;
};
typedef Format<8, 128, S_BLOCK, false> FQ8_0;
typedef Format<4, 8, S_BLOCK, false> FQ4_0;
typedef Format<4, 0, S_BLOCK, true> FQ4_1;
typedef Format<5, 16, S_BLOCK, false> FQ5_0;
typedef Format<5, 0, S_BLOCK, true> FQ5_1;
typedef Format<4, 0, S_SUPER, true> FQ4_K;
typedef Format<5, 0, S_SUPER, true> FQ5_K;
typedef Format<6, 32, S_HALVES, false> FQ6_K;

static int valid_matrix(const vs_matrix* w) {
    if (w->rows <= 0 || w->cols <= 0 || !w->q) return 0;
    switch (w->format) {
        case VS_F16:
        case VS_F32: return 1;
        case VS_Q8_0:
        case VS_Q4_0:
        case VS_Q5_0: return w->cols % QK == 0 && w->d;
        case VS_Q4_1:
        case VS_Q5_1: return w->cols % QK == 0 && w->d && w->m;
        case VS_Q4_K:
        case VS_Q5_K: return w->cols % QK_K == 0 && w->d && w->m && w->sc && w->sm;
        case VS_Q6_K: return w->cols % QK_K == 0 && w->d && w->sc;
    }
    return 0;
}

// The group pointers of group g of a block-format matrix.
struct GroupView {
    const uint8_t* q;
    const uint16_t *d, *m;
    const uint8_t *sc, *sm;
};

template <class FMT>
static inline GroupView group_view(const vs_matrix* w, int g) {
    const size_t nb = w->cols / QK, per = FMT::SCALES == S_BLOCK ? nb : nb / 8;  // scales per lane
    GroupView v;
    v.q = (const uint8_t*)w->q + (size_t)g * nb * FMT::CHUNKS * CHUNK;
    v.d = w->d + (size_t)g * per * VS_GROUP;
    v.m = w->m ? w->m + (size_t)g * per * VS_GROUP : NULL;
    v.sc = w->sc ? w->sc + (size_t)g * nb * (FMT::SCALES == S_HALVES ? 2 : 1) * VS_GROUP : NULL;
    v.sm = w->sm ? w->sm + (size_t)g * nb * VS_GROUP : NULL;
    return v;
}

static inline int32_t load32(const int8_t* p) {  // 4 activation bytes, to broadcast
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#ifdef VS_AVX512

struct Vec {  // VS_GROUP = 16 lanes
    typedef __m512 F;
    typedef __m512i I;
    static inline F zero() { return _mm512_setzero_ps(); }
    static inline I izero() { return _mm512_setzero_si512(); }
    static inline I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
    static inline I bcast(const int8_t* p) { return _mm512_set1_epi32(load32(p)); }
    static inline I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
    static inline I high4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
    static inline I bor(I a, I b) { return _mm512_or_si512(a, b); }
    template <int FROM, int TO>  // bit FROM of every byte, at bit TO (the rest zero)
    static inline I bit(I v) {
        const I moved = FROM <= TO ? _mm512_slli_epi16(v, TO - FROM) : _mm512_srli_epi16(v, FROM - TO);
        return _mm512_and_si512(moved, _mm512_set1_epi8((char)(1 << TO)));
    }
    static inline I dp(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }  // u unsigned, s signed
    static inline I isub(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
    static inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
    static inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
    static inline F halfs(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static inline F u8s(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
    static inline F i8s(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
    static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static inline F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
    static inline F set1(float v) { return _mm512_set1_ps(v); }
    static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
};
#define VS_VNNI 1

#elif defined(VS_AVX2)

struct Vec {  // VS_GROUP = 8 lanes
    typedef __m256 F;
    typedef __m256i I;
    static inline F zero() { return _mm256_setzero_ps(); }
    static inline I izero() { return _mm256_setzero_si256(); }
    static inline I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static inline I bcast(const int8_t* p) { return _mm256_set1_epi32(load32(p)); }
    static inline I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
    static inline I high4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
    static inline I bor(I a, I b) { return _mm256_or_si256(a, b); }
    template <int FROM, int TO>  // bit FROM of every byte, at bit TO (the rest zero)
    static inline I bit(I v) {
        const I moved = FROM <= TO ? _mm256_slli_epi16(v, TO - FROM) : _mm256_srli_epi16(v, FROM - TO);
        return _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << TO)));
    }
    static inline I dp(I acc, I u, I s) {  // u unsigned, s signed; exact while 2 u s fits 16 bits without VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
        return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
    }
    static inline I isub(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
    static inline I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
    static inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
    static inline F halfs(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static inline F u8s(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
    static inline F i8s(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
    static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static inline F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
    static inline F set1(float v) { return _mm256_set1_ps(v); }
    static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
};
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VS_VNNI 1
#endif

#endif

// float16 (uint16_t) or float32 row-major weights, as floats
static inline float weight_at(const uint16_t* w, int j) { return fp16_to_fp32(w[j]); }
static inline float weight_at(const float* w, int j) { return w[j]; }

// The activations a tile of R rows reads: per row, the quantized values and per block d, s, sum and lo.
template <int R>
struct Rows {
    const int8_t* q[R];
    const float *d[R], *s[R];
    const int32_t *sum[R], *lo[R];
};

#ifdef VS_AVX2

// One group of outputs of a block format FMT against R activation rows: out[r * VS_GROUP + l] = y[r, group
// output l].
// A block's integer sums go to P partial accumulators per row, added at the end of the block: integer
// sums are exact, so P changes no result, only how many dot products wait on one another (a row alone
// would otherwise chain all 8 of a block's, each waiting the instruction's latency).
template <int R>
struct Partials {
    enum { P = R == 1 ? 4 : R <= 3 ? 2 : 1 };
};

template <int R, class FMT>
static inline void group_blocks(const GroupView& w, const Rows<R>& x, int nb, float* out) {
    enum { SPLIT = FMT::SCALES == S_HALVES };  // the block's two halves summed apart
    enum { P = Partials<R>::P };
    typename Vec::F acc[R], mins[R], dsup = Vec::zero(), msup = Vec::zero();
    for (int r = 0; r < R; r++) acc[r] = mins[r] = Vec::zero();
    for (int b = 0; b < nb; b++) {
        typename Vec::I isum[R], ihigh[R], part[R][P], hpart[R][P];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) part[r][p] = hpart[r][p] = Vec::izero();
        const uint8_t* wb = w.q + (size_t)b * FMT::CHUNKS * CHUNK;
        for (int c = 0; c < FMT::CHUNKS * CHUNK / 64; c++) _mm_prefetch((const char*)wb + PREFETCH + c * 64, _MM_HINT_T0);
        if (FMT::BITS == 8) {
            for (int c = 0; c < 8; c++) {
                const typename Vec::I u = Vec::load(wb + c * CHUNK);  // q + 128
#ifdef VS_VNNI
                for (int r = 0; r < R; r++)
                    part[r][c % P] = Vec::dp(part[r][c % P], u, Vec::bcast(x.q[r] + b * QK + 4 * c));
#else  // no VNNI: signed weights, |w| times x with w's signs (products of at most 127 * 127)
                const __m256i sw = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
                const __m256i aw = _mm256_sign_epi8(sw, sw);
                for (int r = 0; r < R; r++)
                    part[r][c % P] =
                        Vec::dp(part[r][c % P], aw, _mm256_sign_epi8(Vec::bcast(x.q[r] + b * QK + 4 * c), sw));
#endif
            }
        } else {
            const typename Vec::I p4 = FMT::BITS >= 5 ? Vec::load(wb + 4 * CHUNK) : Vec::izero();
            const typename Vec::I p5 = FMT::BITS >= 6 ? Vec::load(wb + 5 * CHUNK) : Vec::izero();
#define VS_CHUNK(c)                                                                                         \
    {                                                                                                       \
        const typename Vec::I v = Vec::load(wb + c * CHUNK);                                                \
        typename Vec::I lo = Vec::low4(v), hi = Vec::high4(v);                                              \
        if (FMT::BITS >= 5) lo = Vec::bor(lo, Vec::bit<c, 4>(p4)), hi = Vec::bor(hi, Vec::bit<c + 4, 4>(p4)); \
        if (FMT::BITS >= 6) lo = Vec::bor(lo, Vec::bit<c, 5>(p5)), hi = Vec::bor(hi, Vec::bit<c + 4, 5>(p5)); \
        for (int r = 0; r < R; r++) {                                                                       \
            typename Vec::I& low = part[r][(2 * c) % P];                                                    \
            low = Vec::dp(low, lo, Vec::bcast(x.q[r] + b * QK + 4 * c));                                    \
            typename Vec::I& high = SPLIT ? hpart[r][c % P] : part[r][(2 * c + 1) % P];                     \
            high = Vec::dp(high, hi, Vec::bcast(x.q[r] + b * QK + 16 + 4 * c));                             \
        }                                                                                                   \
    }
            VS_CHUNK(0) VS_CHUNK(1) VS_CHUNK(2) VS_CHUNK(3)
#undef VS_CHUNK
        }
        for (int r = 0; r < R; r++) {  // the partial sums added (exact), in a fixed order
            isum[r] = part[r][0];
            ihigh[r] = hpart[r][0];
            for (int p = 1; p < P; p++) {
                isum[r] = Vec::iadd(isum[r], part[r][p]);
                if (SPLIT) ihigh[r] = Vec::iadd(ihigh[r], hpart[r][p]);
            }
        }
        if (FMT::SCALES == S_BLOCK) {
            const typename Vec::F dw = Vec::halfs(w.d + (size_t)b * VS_GROUP);
            const typename Vec::F mw = FMT::MIN ? Vec::halfs(w.m + (size_t)b * VS_GROUP) : Vec::zero();
            for (int r = 0; r < R; r++) {
#ifdef VS_VNNI
                if (FMT::OFFSET) isum[r] = Vec::isub(isum[r], FMT::OFFSET * x.sum[r][b]);  // exact
#else
                if (FMT::OFFSET && FMT::BITS != 8) isum[r] = Vec::isub(isum[r], FMT::OFFSET * x.sum[r][b]);
#endif
                acc[r] = Vec::fma(Vec::mul(dw, Vec::set1(x.d[r][b])), Vec::cvt(isum[r]), acc[r]);
                if (FMT::MIN) mins[r] = Vec::fma(mw, Vec::set1(x.s[r][b]), mins[r]);
            }
        } else if (FMT::SCALES == S_SUPER) {
            if (b % 8 == 0) {
                dsup = Vec::halfs(w.d + (size_t)(b / 8) * VS_GROUP);
                msup = Vec::halfs(w.m + (size_t)(b / 8) * VS_GROUP);
            }
            const typename Vec::F dw = Vec::mul(dsup, Vec::u8s(w.sc + (size_t)b * VS_GROUP));  // exact
            const typename Vec::F mw = Vec::mul(msup, Vec::u8s(w.sm + (size_t)b * VS_GROUP));  // exact
            for (int r = 0; r < R; r++) {
                acc[r] = Vec::fma(Vec::mul(dw, Vec::set1(x.d[r][b])), Vec::cvt(isum[r]), acc[r]);
                mins[r] = Vec::fnma(mw, Vec::set1(x.s[r][b]), mins[r]);
            }
        } else {  // S_HALVES
            if (b % 8 == 0) dsup = Vec::halfs(w.d + (size_t)(b / 8) * VS_GROUP);
            const typename Vec::F d0 = Vec::mul(dsup, Vec::i8s(w.sc + (size_t)2 * b * VS_GROUP));  // exact
            const typename Vec::F d1 = Vec::mul(dsup, Vec::i8s(w.sc + (size_t)(2 * b + 1) * VS_GROUP));
            for (int r = 0; r < R; r++) {
                const int lo = x.lo[r][b], hi = x.sum[r][b] - lo;
                const typename Vec::F xd = Vec::set1(x.d[r][b]);
                acc[r] = Vec::fma(Vec::mul(d0, xd), Vec::cvt(Vec::isub(isum[r], FMT::OFFSET * lo)), acc[r]);
                acc[r] = Vec::fma(Vec::mul(d1, xd), Vec::cvt(Vec::isub(ihigh[r], FMT::OFFSET * hi)), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) Vec::store(out + r * VS_GROUP, FMT::MIN ? Vec::add(acc[r], mins[r]) : acc[r]);
}

#ifdef VS_AVX512
static inline float hsum16(__m512 v) {  // fixed order: halves, then as hsum8
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#endif

#ifdef VS_AVX512
static inline __m512 weights16(const uint16_t* w) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w)); }
static inline __m512 weights16(const float* w) { return _mm512_loadu_ps(w); }
#else
static inline __m256 weights8(const uint16_t* w) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)); }
static inline __m256 weights8(const float* w) { return _mm256_loadu_ps(w); }
#endif

template <int R, class T>
static inline void tile_row(const T* w, const float* const* x, int cols, float* out) {
    int k = 0;
    float sums[R];
#ifdef VS_AVX512
    __m512 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (; k + 32 <= cols; k += 32) {
        const __m512 w0 = weights16(w + k), w1 = weights16(w + k + 16);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + k), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + k + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum16(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (; k + 16 <= cols; k += 16) {
        const __m256 w0 = weights8(w + k), w1 = weights8(w + k + 8);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
    for (int r = 0; r < R; r++) {
        for (int j = k; j < cols; j++) sums[r] += weight_at(w, j) * x[r][j];
        out[r] = sums[r];
    }
}

#else  // portable: plain loops over the same layouts

// u of weight k (of 32) of lane l in block wb of a block format with BITS bits
template <int BITS>
static inline int unpacked(const uint8_t* wb, int l, int k) {
    if (BITS == 8) return wb[(k / 4) * CHUNK + 4 * l + k % 4];
    const int half = k / 16, c = (k % 16) / 4, j = k % 4;
    const int byte = wb[c * CHUNK + 4 * l + j];
    int u = half ? byte >> 4 : byte & 15;
    if (BITS >= 5) u |= ((wb[4 * CHUNK + 4 * l + j] >> (c + 4 * half)) & 1) << 4;
    if (BITS >= 6) u |= ((wb[5 * CHUNK + 4 * l + j] >> (c + 4 * half)) & 1) << 5;
    return u;
}

template <int R, class FMT>
static inline void group_blocks(const GroupView& w, const Rows<R>& x, int nb, float* out) {
    for (int r = 0; r < R; r++) {
        for (int l = 0; l < VS_GROUP; l++) {
            float acc = 0.0f, mins = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t* wb = w.q + (size_t)b * FMT::CHUNKS * CHUNK;
                int sums[2] = {0, 0};  // the block's first and last 16 products
                for (int k = 0; k < QK; k++) sums[k / 16] += (unpacked<FMT::BITS>(wb, l, k) - FMT::OFFSET) * x.q[r][b * QK + k];
                const float xd = x.d[r][b];
                if (FMT::SCALES == S_BLOCK) {
                    acc += fp16_to_fp32(w.d[(size_t)b * VS_GROUP + l]) * xd * (float)(sums[0] + sums[1]);
                    if (FMT::MIN) mins += fp16_to_fp32(w.m[(size_t)b * VS_GROUP + l]) * x.s[r][b];
                } else if (FMT::SCALES == S_SUPER) {
                    const float d = fp16_to_fp32(w.d[(size_t)(b / 8) * VS_GROUP + l]) * (float)w.sc[(size_t)b * VS_GROUP + l];
                    const float m = fp16_to_fp32(w.m[(size_t)(b / 8) * VS_GROUP + l]) * (float)w.sm[(size_t)b * VS_GROUP + l];
                    acc += d * xd * (float)(sums[0] + sums[1]);
                    mins -= m * x.s[r][b];
                } else {
                    const float d = fp16_to_fp32(w.d[(size_t)(b / 8) * VS_GROUP + l]);
                    for (int h = 0; h < 2; h++)
                        acc += d * (float)(int8_t)w.sc[(size_t)(2 * b + h) * VS_GROUP + l] * xd * (float)sums[h];
                }
            }
            out[r * VS_GROUP + l] = acc + mins;
        }
    }
}

template <int R, class T>
static inline void tile_row(const T* w, const float* const* x, int cols, float* out) {
    for (int r = 0; r < R; r++) {
        float sum = 0.0f;
        for (int k = 0; k < cols; k++) sum += weight_at(w, k) * x[r][k];
        out[r] = sum;
    }
}

#endif

// rows r0 .. r0 + R - 1 of x against float16 or float32 row o: out[r]
template <int R>
static inline void tile_rows(const vs_matrix* w, int o, int r0, const float* x, float* out) {
    const float* xr[R];
    for (int r = 0; r < R; r++) xr[r] = x + (size_t)(r0 + r) * w->cols;
    if (w->format == VS_F16)
        tile_row<R>((const uint16_t*)w->q + (size_t)o * w->cols, xr, w->cols, out);
    else
        tile_row<R>((const float*)w->q + (size_t)o * w->cols, xr, w->cols, out);
}

// rows r0 .. r0 + R - 1 of the quantized x against group g: out[r * VS_GROUP + l]
template <int R>
static inline void tile_group(const vs_matrix* w, int g, int r0, const vs_qrows* qx, float* out) {
    const int cols = w->cols, nb = cols / QK;
    Rows<R> x;
    for (int r = 0; r < R; r++) {
        x.q[r] = qx->q + (size_t)(r0 + r) * cols;
        x.d[r] = qx->d + (size_t)(r0 + r) * nb;
        x.s[r] = qx->s + (size_t)(r0 + r) * nb;
        x.sum[r] = qx->sum + (size_t)(r0 + r) * nb;
        x.lo[r] = qx->lo + (size_t)(r0 + r) * nb;
    }
    switch (w->format) {
#define VS_FORMAT(CODE, FMT) \
    case CODE: group_blocks<R, FMT>(group_view<FMT>(w, g), x, nb, out); break;
        VS_FORMAT(VS_Q8_0, FQ8_0) VS_FORMAT(VS_Q4_0, FQ4_0) VS_FORMAT(VS_Q4_1, FQ4_1) VS_FORMAT(VS_Q5_0, FQ5_0)
        VS_FORMAT(VS_Q5_1, FQ5_1) VS_FORMAT(VS_Q4_K, FQ4_K) VS_FORMAT(VS_Q5_K, FQ5_K) VS_FORMAT(VS_Q6_K, FQ6_K)
#undef VS_FORMAT
    }
}

static inline int row_major(const vs_matrix* w) { return w->format == VS_F16 || w->format == VS_F32; }

// The units a product's threads split: an output row (float16, float32) or a group of VS_GROUP outputs.
static inline int units(const vs_matrix* w) { return row_major(w) ? w->rows : (w->rows + VS_GROUP - 1) / VS_GROUP; }

// Unit u of y[:, 0 .. rows) = x [n, cols] W^T (+ bias), y's rows `stride` apart; `qx`: x quantized (block
// formats), ignored for float16 and float32.
static void product_unit(const vs_matrix* w, int u, int n, const float* x, const vs_qrows* qx, float* y,
                         size_t stride) {
    const int rows = w->rows;
    if (row_major(w)) {
        float out[TILE];
        const float bias = w->bias ? w->bias[u] : 0.0f;
        for (int r0 = 0; r0 < n; r0 += TILE) {
            const int size = n - r0 < TILE ? n - r0 : TILE;
            switch (size) {
                case 1: tile_rows<1>(w, u, r0, x, out); break;
                case 2: tile_rows<2>(w, u, r0, x, out); break;
                case 3: tile_rows<3>(w, u, r0, x, out); break;
                default: tile_rows<4>(w, u, r0, x, out); break;
            }
            for (int r = 0; r < size; r++) y[(size_t)(r0 + r) * stride + u] = out[r] + bias;
        }
        return;
    }
    const int g = u;
    float out[GROUP_TILE * VS_GROUP];
    for (int r0 = 0; r0 < n; r0 += GROUP_TILE) {
        const int size = n - r0 < GROUP_TILE ? n - r0 : GROUP_TILE;
        switch (size) {
            case 1: tile_group<1>(w, g, r0, qx, out); break;
            case 2: tile_group<2>(w, g, r0, qx, out); break;
            case 3: tile_group<3>(w, g, r0, qx, out); break;
#if GROUP_TILE == 8
            case 4: tile_group<4>(w, g, r0, qx, out); break;
            case 5: tile_group<5>(w, g, r0, qx, out); break;
            case 6: tile_group<6>(w, g, r0, qx, out); break;
            case 7: tile_group<7>(w, g, r0, qx, out); break;
            default: tile_group<8>(w, g, r0, qx, out); break;
#else
            default: tile_group<4>(w, g, r0, qx, out); break;
#endif
        }
        const int o0 = g * VS_GROUP;
#ifdef VS_AVX2
        if (o0 + VS_GROUP <= rows) {  // a whole group: its lanes are consecutive outputs, stored at once
            const Vec::F bias = w->bias ? Vec::loadf(w->bias + o0) : Vec::zero();
            for (int r = 0; r < size; r++)
                Vec::store(y + (size_t)(r0 + r) * stride + o0, Vec::add(Vec::loadf(out + r * VS_GROUP), bias));
            continue;
        }
#endif
        for (int l = 0; l < VS_GROUP && o0 + l < rows; l++) {
            const int o = o0 + l;
            const float bias = w->bias ? w->bias[o] : 0.0f;
            for (int r = 0; r < size; r++) y[(size_t)(r0 + r) * stride + o] = out[r * VS_GROUP + l] + bias;
        }
    }
}

// y [n, Σ rows] = x [n, cols] times the stack's matrices, their outputs side by side (one matrix: W^T), in
// one parallel loop over the units of them all; x quantized once for the block formats among them.
// Returns 0, or -2 when out of memory.
static int matmul_stack(const vs_stack* s, int n, const float* x, float* y, int threads) {
    vs_qrows qx = {NULL, NULL, NULL, NULL, NULL};
    int total = 0, offset[VS_STACK + 1] = {0}, first[VS_STACK + 1] = {0};  // per part: output and unit offsets
    for (int p = 0; p < s->count; p++) {
        if (!row_major(&s->part[p]) && !qx.q) {
            const int status = quantize(n, s->part[p].cols, x, &qx, threads);
            if (status) return status;
        }
        offset[p + 1] = offset[p] + s->part[p].rows;
        first[p + 1] = first[p] + units(&s->part[p]);
        total = first[p + 1];
    }
    const size_t stride = offset[s->count];
    parallel_for(total, threads, [&](int u) {
        int p = 0;
        while (u >= first[p + 1]) p++;
        product_unit(&s->part[p], u - first[p], n, x, &qx, y + offset[p], stride);
    });
    return 0;
}

static int matmul(const vs_matrix* w, int n, const float* x, float* y, int threads) {
    vs_stack one;
    one.count = 1;
    one.part[0] = *w;
    return matmul_stack(&one, n, x, y, threads);
}

// ------------------------------------------------------------------------------------------ layer pieces

static inline void rmsnorm_row(const float* x, int dim, const float* weight, float eps, float* y) {
    const float ss = dot_f32(x, x, dim);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int j = 0; j < dim; j++) y[j] = weight[j] * (x[j] * inv);
}

static void rmsnorm(int n, int dim, const float* x, const float* weight, float eps, float* y, int threads) {
    parallel_for(n, threads, [&](int r) { rmsnorm_row(x + (size_t)r * dim, dim, weight, eps, y + (size_t)r * dim); });
}

// The residual stream h [n, dim] += x, then (with a weight) x = rmsnorm(h) * weight: one pass per row.
static void add_rmsnorm(int n, int dim, float* h, float* x, const float* weight, float eps, int threads) {
    parallel_for(n, threads, [&](int r) {
        float* hr = h + (size_t)r * dim;
        float* xr = x + (size_t)r * dim;
        for (int j = 0; j < dim; j++) hr[j] += xr[j];
        if (weight) rmsnorm_row(hr, dim, weight, eps, xr);
    });
}

// x [head_dim] rotated in place at one position (transformers' rotate_half layout)
static inline void rope(float* x, const float* cos, const float* sin, int half) {
    for (int j = 0; j < half; j++) {
        const float a = x[j], b = x[j + half];
        x[j] = a * cos[j] - b * sin[j];
        x[j + half] = b * cos[j] + a * sin[j];
    }
}

static inline int visible(const vs_batch* batch, int i, int s) {  // may token i see slot s of its row?
    const int base = batch->base[i];
    if (s < base) return 1;
    if (!batch->mask) return s <= batch->slot[i];
    const int j = s - base;
    return j < batch->mask_cols && batch->mask[(size_t)i * batch->mask_cols + j];
}

static inline uint16_t fp32_to_fp16(float f) {
#ifdef VS_AVX2
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else  // round to nearest even, with subnormals, infinities and NaN
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t mag = x & 0x7fffffff;
    if (mag >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (mag > 0x7f800000 ? 0x200 : 0));
    if (mag >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds past the largest float16
    if (mag < 0x38800000) {  // a float16 subnormal (or zero): add the magic number and let the FPU round
        float v;
        const uint32_t bits = mag;
        memcpy(&v, &bits, 4);
        v += 0.5f;
        uint32_t r;
        memcpy(&r, &v, 4);
        return (uint16_t)(sign | (r - 0x3f000000));
    }
    const uint32_t odd = (mag >> 13) & 1;
    return (uint16_t)(sign | ((mag + 0xc8000fff + odd) >> 13));
#endif
}

// exp of a vector of floats: Cephes' polynomial on r = x - n ln 2 (n = round(x / ln 2)), scaled by 2^n;
// within 2 ulp of expf; inputs below -87.3 give 0. One template for the 16- and 8-lane types below.
#ifdef VS_AVX2
template <class V>
static inline typename V::F vexp(typename V::F x) {
    typedef typename V::F F;
    const F lo = V::set1(-87.3f);
    const F keep = V::ge(x, lo);
    x = V::min(V::max(x, lo), V::set1(88.3f));
    const F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
    F r = V::fnma(n, V::set1(0.693359375f), x);
    r = V::fnma(n, V::set1(-2.12194440e-4f), r);
    F p = V::set1(1.9875691500e-4f);
    p = V::fma(p, r, V::set1(1.3981999507e-3f));
    p = V::fma(p, r, V::set1(8.3334519073e-3f));
    p = V::fma(p, r, V::set1(4.1665795894e-2f));
    p = V::fma(p, r, V::set1(1.6666665459e-1f));
    p = V::fma(p, r, V::set1(5.0000001201e-1f));
    p = V::fma(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
    return V::select(keep, V::pow2(p, n));
}

struct F8 {  // 8 floats (AVX2)
    typedef __m256 F;
    static inline F set1(float v) { return _mm256_set1_ps(v); }
    static inline F load(const float* p) { return _mm256_loadu_ps(p); }
    static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
    static inline F ge(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
    static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
    static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
    static inline F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
    static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static inline F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static inline F pow2(F p, F n) {  // p 2^n, n integral in [-126, 127]
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static inline F select(F mask, F v) { return _mm256_and_ps(mask, v); }
};
#endif

#ifdef VS_AVX512
struct F16 {  // 16 floats (AVX-512): the same steps as F8
    typedef __m512 F;
    static inline F set1(float v) { return _mm512_set1_ps(v); }
    static inline F load(const float* p) { return _mm512_loadu_ps(p); }
    static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
    static inline F ge(F a, F b) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), _mm512_castsi512_ps(_mm512_set1_epi32(-1))); }
    static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
    static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
    static inline F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
    static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static inline F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static inline F pow2(F p, F n) { return _mm512_scalef_ps(p, n); }
    static inline F select(F mask, F v) { return _mm512_and_ps(mask, v); }
};
#endif

// silu(g) u = g / (1 + exp(-g)) u
#ifdef VS_AVX2
template <class V>
static inline typename V::F silu_times(typename V::F g, typename V::F u) {
    return V::mul(V::div(g, V::add(V::set1(1.0f), vexp<V>(V::sub(V::set1(0.0f), g)))), u);
}

// gelu_tanh(g) u = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) u, tanh(z) = 1 - 2 / (exp(2 z) + 1)
template <class V>
static inline typename V::F gelu_times(typename V::F g, typename V::F u) {
    const typename V::F z = V::mul(V::set1(0.7978845608028654f), V::fma(V::mul(V::set1(0.044715f), g), V::mul(g, g), g));
    const typename V::F t = V::sub(V::set1(1.0f), V::div(V::set1(2.0f), V::add(vexp<V>(V::add(z, z)), V::set1(1.0f))));
    return V::mul(V::mul(V::mul(V::set1(0.5f), g), V::add(V::set1(1.0f), t)), u);
}
#endif

// a[j] = act(gate[j]) up[j] for j < len (act: VS_SILU or VS_GELU_TANH), every element by the same vector code
// (the tail through a zero-padded copy), whatever its lane.
static inline void gated(int activation, const float* gate, const float* up, float* a, int len) {
    int j = 0;
#ifdef VS_AVX2
#ifdef VS_AVX512
    typedef F16 V;
#else
    typedef F8 V;
#endif
    enum { W = sizeof(typename V::F) / sizeof(float) };
    const auto act = [activation](V::F g, V::F u) {
        return activation == VS_GELU_TANH ? gelu_times<V>(g, u) : silu_times<V>(g, u);
    };
    for (; j + W <= len; j += W) V::store(a + j, act(V::load(gate + j), V::load(up + j)));
    if (j < len) {
        float g[W] = {}, u[W] = {}, out[W];
        memcpy(g, gate + j, sizeof(float) * (len - j));
        memcpy(u, up + j, sizeof(float) * (len - j));
        V::store(out, act(V::load(g), V::load(u)));
        memcpy(a + j, out, sizeof(float) * (len - j));
    }
#else
    for (; j < len; j++)
        a[j] = activation == VS_GELU_TANH
                   ? 0.5f * gate[j] * (1.0f + tanhf(0.7978845608028654f * (gate[j] + 0.044715f * gate[j] * gate[j] * gate[j]))) * up[j]
                   : gate[j] / (1.0f + expf(-gate[j])) * up[j];
#endif
}

// s[t] = exp(s[t] - top) for t < len, in place: every slot's exp from the same code (the vector exp, the tail
// through a padded copy), whatever its lane.
static inline void exp_shifted(float* s, int len, float top) {
    int t = 0;
#ifdef VS_AVX512
    for (; t + 16 <= len; t += 16)
        _mm512_storeu_ps(s + t, vexp<F16>(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top))));
    if (t < len) {
        float tail[16];
        for (int j = 0; j < 16; j++) tail[j] = t + j < len ? s[t + j] : -INFINITY;
        _mm512_storeu_ps(tail, vexp<F16>(_mm512_sub_ps(_mm512_loadu_ps(tail), _mm512_set1_ps(top))));
        for (int j = 0; t + j < len; j++) s[t + j] = tail[j];
    }
#elif defined(VS_AVX2)
    for (; t + 8 <= len; t += 8)
        _mm256_storeu_ps(s + t, vexp<F8>(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top))));
    if (t < len) {
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = t + j < len ? s[t + j] : -INFINITY;
        _mm256_storeu_ps(tail, vexp<F8>(_mm256_sub_ps(_mm256_loadu_ps(tail), _mm256_set1_ps(top))));
        for (int j = 0; t + j < len; j++) s[t + j] = tail[j];
    }
#else
    for (; t < len; t++) s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - top);
#endif
}

// x[0] + ... + x[n - 1] in an order fixed by n alone: a partial sum per vector lane (by position), then the
// lanes added in a fixed order. The same values at the same positions give the same sum.
static inline float sum_of(const float* x, int n) {
    int t = 0;
#ifdef VS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + t));
    if (t < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - t)) - 1), x + t));
    return hsum16(acc);
#elif defined(VS_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + t));
    if (t < n) {
        float tail[8] = {};
        memcpy(tail, x + t, sizeof(float) * (n - t));
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(tail));
    }
    return hsum8(acc);
#else
    float total = 0.0f;
    for (; t < n; t++) total += x[t];
    return total;
#endif
}

enum { ATT_CHUNK = 128, ATT_ROWS = 4 };  // slots per attention chunk; query heads per tile
#ifdef VS_AVX512
#define ATT_PAIRS 12  // (token, query head) pairs per tile: the tokens of a causal block share key loads
#else
#define ATT_PAIRS 4
#endif
enum { ATT_TOKENS = 12 };  // tokens per attention task at most: a multiple of the tokens per tile

#ifdef VS_AVX512
// J consecutive key tiles from `tile` against R queries: scores[r * stride + 16 j + lane] (J R independent
// sums in flight); the next J tiles prefetched.
template <int R, int J>
static inline void key_tiles(const uint16_t* tile, int hd, const float* const* q, float scale, float* scores,
                             int stride) {
    __m512 acc[R][J];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        if (d % 2 == 0)
            for (int j = 0; j < J; j++) _mm_prefetch((const char*)(tile + ((J + j) * hd + d) * KT), _MM_HINT_T0);
        __m512 k[J];
        for (int j = 0; j < J; j++) k[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tile + (j * hd + d) * KT)));
        for (int r = 0; r < R; r++) {
            const __m512 qd = _mm512_set1_ps(q[r][d]);
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(qd, k[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) _mm512_storeu_ps(scores + r * stride + j * KT, _mm512_mul_ps(acc[r][j], _mm512_set1_ps(scale)));
}
#endif

// scores[r * stride + t - c0] = scale q_r . k_t for the slots t in [c0, c1) of one cache row, R queries;
// whole tiles of 16 are written (stride: a multiple of 16), the lanes past c1 hold scores of no slot.
template <int R>
static inline void scores_tile(const uint16_t* ktiles, int hd, const float* const* q, int c0, int c1, float scale,
                               float* scores, int stride) {
    int t0 = c0;  // a multiple of 16
#ifdef VS_AVX512
    for (; R <= 4 && t0 + 2 * KT <= c1; t0 += 2 * KT)  // few queries: two tiles at a time, for more sums in flight
        key_tiles<R, 2>(ktiles + (size_t)(t0 / KT) * hd * KT, hd, q, scale, scores + t0 - c0, stride);
#endif
    for (; t0 < c1; t0 += KT) {
        const uint16_t* tile = ktiles + (size_t)(t0 / KT) * hd * KT;
#ifdef VS_AVX512
        key_tiles<R, 1>(tile, hd, q, scale, scores + t0 - c0, stride);
#elif defined(VS_AVX2)
        __m256 acc[R][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tile + d * KT)));
            const __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tile + d * KT + 8)));
            for (int r = 0; r < R; r++) {
                const __m256 qd = _mm256_set1_ps(q[r][d]);
                acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(scores + r * stride + t0 - c0, _mm256_mul_ps(acc[r][0], _mm256_set1_ps(scale)));
            _mm256_storeu_ps(scores + r * stride + t0 - c0 + 8, _mm256_mul_ps(acc[r][1], _mm256_set1_ps(scale)));
        }
#else
        for (int r = 0; r < R; r++)
            for (int lane = 0; lane < KT; lane++) {
                float acc = 0.0f;
                for (int d = 0; d < hd; d++) acc += q[r][d] * fp16_to_fp32(tile[d * KT + lane]);
                scores[r * stride + t0 - c0 + lane] = acc * scale;
            }
#endif
    }
}

// The largest of s[0 .. len) (exact: the order does not matter).
static inline float max_of(const float* s, int len) {
    int t = 0;
    float top = -INFINITY;
#ifdef VS_AVX512
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= len; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
    top = _mm512_reduce_max_ps(m);
#elif defined(VS_AVX2)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= len; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; t < len; t++) top = s[t] > top ? s[t] : top;
    return top;
}

#ifdef VS_AVX512
enum { VB = 4 };  // dimension blocks of the vector width that values_tile accumulates in one pass
#else
enum { VB = 2 };  // (16 AVX2 registers: up to 4 heads x 2 blocks of accumulators)
#endif

// o_r[d] = sum over t in [c0, c1) of p_r[t] v_t[d] for R queries, in slot order: up to VB vectors of dimensions
// per pass (fewer for more than 4 queries: 4 VB accumulators at most), so that each value row is read and
// converted once for those dimensions and every query.
template <int R>
static inline void values_tile(const uint16_t* values, int hd, int c0, int c1, const float* p, int stride,
                               float* const* o) {
    int d0 = 0;
#if defined(VS_AVX512) || defined(VS_AVX2)
    enum { W = VS_GROUP, VBR = R <= 4 ? VB : 4 * VB / R > 1 ? 4 * VB / R : 1 };
    for (; d0 + W <= hd;) {
        const int blocks = (hd - d0) / W < VBR ? (hd - d0) / W : VBR;
        Vec::F acc[R][VBR];
        for (int r = 0; r < R; r++)
            for (int b = 0; b < VBR; b++) acc[r][b] = Vec::zero();
        const float* pr[R];  // pr[r][t]: the weight of slot t
        for (int r = 0; r < R; r++) pr[r] = p + (size_t)r * stride - c0;
        for (int t = c0; t < c1; t++) {
            const uint16_t* row = values + (size_t)t * hd + d0;
            _mm_prefetch((const char*)(row + 16 * hd), _MM_HINT_T0);
            for (int b = 0; b < blocks; b++) {
                const Vec::F v = Vec::halfs(row + b * W);
                for (int r = 0; r < R; r++) acc[r][b] = Vec::fma(Vec::set1(pr[r][t]), v, acc[r][b]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int b = 0; b < blocks; b++) Vec::store(o[r] + d0 + b * W, acc[r][b]);
        d0 += blocks * W;
    }
#endif
    for (; d0 < hd; d0++)
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
            for (int t = c0; t < c1; t++) acc += p[r * stride + t - c0] * fp16_to_fp32(values[(size_t)t * hd + d0]);
            o[r][d0] = acc;
        }
}

// The first slot token i sees in layer `layer`: 0, or in a sliding-window layer the slot of the first
// position of its window (never past its new slots, which a tree shallower than the window sees whole).
static inline int window_start(const vs_model* m, int layer, const vs_batch* batch, int i) {
    const int window = m->layers[layer].window;
    if (window <= 0) return 0;
    const int lo = batch->pos[i] - window + 1;
    return lo < 0 ? 0 : batch->mask && lo > batch->base[i] ? batch->base[i] : lo;
}

// The slots token i sees, counted: its row's slots [lo, base) and the new slots its mask (or causality) shows.
static inline int visible_count(const vs_batch* batch, int i, int lo) {
    if (!batch->mask) return batch->slot[i] + 1 - lo;
    int count = batch->base[i] - lo;
    for (int j = 0; j < batch->mask_cols; j++) count += batch->mask[(size_t)i * batch->mask_cols + j] != 0;
    return count;
}

// The slot of token i's k-th visible slot (k < visible_count): slot lo + k below base, else the new slot that
// is the (lo + k - base)-th its mask shows.
static inline int visible_slot(const vs_batch* batch, int i, int k, int lo) {
    const int base = batch->base[i];
    k += lo;
    if (k < base || !batch->mask) return k;
    for (int j = 0, seen = base; j < batch->mask_cols; j++)
        if (batch->mask[(size_t)i * batch->mask_cols + j] && seen++ == k) return base + j;
    return base + batch->mask_cols;  // not reached for k < visible_count
}

// One task: tokens ids[0 .. T) of one cache row, query heads h0 .. h0 + R - 1 (one kv head's), P = T R pairs
// (token, head), pair t R + r; token t's visible slots of ranks [k0, k1[t]) (the k-th slot it sees has
// rank k). Several tokens only in a causal block (no mask), where ranks are slots: their scores are computed
// together over the union of their slots, each token's own slots past its last set to -inf, which adds
// exact zeros below. Chunks go by rank, not by slot, so that a token tree's node — its ancestors and itself
// at slots after masked siblings — falls into the chunks of the same token decoded alone, and its attention
// is computed the same: every slot's score and exp by the same code whatever its lane, the weights summed by
// rank (gathered first where the mask hides slots in between), the values accumulated in slot order, the
// hidden slots adding exact zeros. Writes, per pair, the chunk's max score m, sum of exp(score - m) l, and
// unnormalised output [hd] to part.
template <int P>
static inline void attention_task(const vs_model* m, int layer, const vs_batch* batch, const vs_cache* cache,
                                  const float* q, int q_stride, const int* ids, int T, int h0, int k0, const int* k1,
                                  const int* lo, float* const* part) {
    const int R = P / T, hd = m->head_dim, g = h0 / (m->heads / m->kv_heads);
    const size_t row = ((size_t)layer * cache->batch + batch->seq[ids[0]]) * m->kv_heads + g;
    const uint16_t* keys = cache->k + row * cache->capacity * hd;
    const uint16_t* values = cache->v + row * cache->capacity * hd;
    const float* qh[P];
    int first[P], end[P];  // per token (the first T entries): its first visible slot, and one past its last
    for (int t = 0; t < T; t++) {
        first[t] = visible_slot(batch, ids[t], k0, lo[ids[t]]);
        end[t] = visible_slot(batch, ids[t], k1[t] - 1, lo[ids[t]]) + 1;
        for (int r = 0; r < R; r++) qh[t * R + r] = q + (size_t)ids[t] * q_stride + (size_t)(h0 + r) * hd;
    }
    int c0 = first[0], c1 = end[0];
    for (int t = 1; t < T; t++) c0 = first[t] < c0 ? first[t] : c0, c1 = end[t] > c1 ? end[t] : c1;
    c0 -= c0 % KT;  // key tiles start at multiples of 16 (the same for every token)
    const int len = c1 - c0, stride = (len + KT - 1) / KT * KT;  // whole tiles per pair
    thread_local std::vector<float> buffer;
    if ((int)buffer.size() < P * stride) buffer.resize((size_t)P * stride);
    float* scores = buffer.data();
    scores_tile<P>(keys, hd, qh, c0, c1, m->attn_scale, scores, stride);
    thread_local std::vector<float> gathered;
    float* o[P];
    for (int t = 0; t < T; t++) {
        const int i = ids[t], base = batch->base[i];
        for (int s = c0; s < c1; s++)  // slots of the chunk before, new slots it may not see, and past its last
            if (s < first[t] || s >= end[t] || (s >= base && batch->mask && !visible(batch, i, s)))
                for (int r = 0; r < R; r++) scores[(t * R + r) * stride + s - c0] = -INFINITY;
        // The weights' sum goes by rank: the chunk's visible slots are [first, end) unless a tree mask hides
        // some of them, whose weights are then gathered first, so that the sum is the same token's decoded
        // alone.
        const int ranks = k1[t] - k0;
        if (end[t] - first[t] != ranks && (int)gathered.size() < ranks) gathered.resize(ranks);
        for (int r = 0; r < R; r++) {
            const int pair = t * R + r;
            float* own = scores + pair * stride;
            const float top = max_of(own, len);  // a chunk with a visible slot has a finite top
            exp_shifted(own, len, top);
            const float* weights = own + (first[t] - c0);
            if (end[t] - first[t] != ranks) {
                for (int s = first[t], k = 0; s < end[t]; s++)
                    if (s < base || visible(batch, i, s)) gathered[k++] = own[s - c0];
                weights = gathered.data();
            }
            part[pair][0] = top;
            part[pair][1] = sum_of(weights, ranks);
            o[pair] = part[pair] + 2;
        }
    }
    values_tile<P>(values, hd, c0, c1, scores, stride, o);  // in slot order: the hidden slots add exact zeros
}

// out [N, heads head_dim]: attention of every token's heads over the visible slots of its cache row, in
// chunks of ATT_CHUNK slots merged in chunk order: the same arithmetic whatever N and the threads. A task is
// one cache row of the batch, kv head and chunk, for up to ATT_TOKENS of that row's tokens that see the chunk
// (tiles of up to ATT_ROWS of the kv head's query heads, and of ATT_PAIRS token-head pairs in a causal
// block), so that the chunk's keys and values come from memory once for many tokens; the threads take
// contiguous runs of tasks of about equal work, a row's tasks one after another.
static int attention(const vs_model* m, int layer, const vs_batch* batch, const vs_cache* cache, const float* q,
                     int q_stride, float* out, int threads) {
    const int n = batch->n, heads = m->heads, hd = m->head_dim, group = heads / m->kv_heads;
    std::vector<int> seen(n), lo(n);            // the slots each token sees, counted once, from slot lo
    std::vector<int> row_of(cache->batch, -1);  // cache row → its index among the batch's rows
    std::vector<int> row_chunks, start(1, 0);   // per batch row: the chunks its tokens see; where they start
    int chunks = 1;
    for (int i = 0; i < n; i++) {
        lo[i] = window_start(m, layer, batch, i);
        seen[i] = visible_count(batch, i, lo[i]);
        int& row = row_of[batch->seq[i]];
        if (row < 0) {
            row = (int)row_chunks.size();
            row_chunks.push_back(0);
            start.push_back(0);
        }
        const int c = (seen[i] + ATT_CHUNK - 1) / ATT_CHUNK;
        row_chunks[row] = c > row_chunks[row] ? c : row_chunks[row];
        chunks = c > chunks ? c : chunks;
        start[row + 1]++;
    }
    const int rows = (int)row_chunks.size();
    for (int r = 0; r < rows; r++) start[r + 1] += start[r];  // row r's tokens: order[start[r] .. start[r + 1])
    std::vector<int> order(n), next(start.begin(), start.end() - 1);
    for (int i = 0; i < n; i++) order[next[row_of[batch->seq[i]]]++] = i;
    struct Task {
        int row, g, chunk, j0, j1;  // the row's tokens order[j0 .. j1) that see the chunk
    };
    std::vector<Task> tasks;
    std::vector<double> work;  // cumulative: the slots the tasks so far read, over their tokens
    for (int row = 0; row < rows; row++)
        for (int g = 0; g < m->kv_heads; g++)
            for (int chunk = 0, c0 = 0; chunk < row_chunks[row]; chunk++, c0 += ATT_CHUNK) {
                double slots = 0.0;
                for (int j = start[row], j0 = j, taken = 0; j < start[row + 1]; j++) {
                    const int i = order[j];
                    if (seen[i] > c0) {
                        slots += seen[i] - c0 < ATT_CHUNK ? seen[i] - c0 : ATT_CHUNK;
                        taken++;
                    }
                    if (taken == ATT_TOKENS || (j + 1 == start[row + 1] && taken)) {
                        tasks.push_back({row, g, chunk, j0, j + 1});
                        work.push_back((work.empty() ? 0.0 : work.back()) + slots);
                        j0 = j + 1, taken = 0, slots = 0.0;
                    }
                }
            }
    const size_t stride = (size_t)hd + 2;  // per (token, head, chunk): m, l, o[hd]
    float* parts = (float*)thread_buffer(BUF_PARTS, sizeof(float) * (size_t)n * heads * chunks * stride);
    if (!parts) return -2;
    for (int i = 0; i < n; i++)  // the chunks that token i sees nothing of
        for (int h = 0; h < heads; h++)
            for (int c = (seen[i] + ATT_CHUNK - 1) / ATT_CHUNK; c < chunks; c++)
                parts[(((size_t)i * heads + h) * chunks + c) * stride] = -INFINITY;
    const int shares = threads < (int)tasks.size() ? threads : (int)tasks.size();
    std::vector<int> split(shares + 1, (int)tasks.size());  // share t: tasks [split[t], split[t + 1])
    for (int t = 0, k = 0; t < shares; t++) {
        while (k < (int)tasks.size() && (k == 0 ? 0.0 : work[k - 1]) < work.back() * t / shares) k++;
        split[t] = k;
    }
    parallel_for(shares, threads, [&](int share) {
        for (int k = split[share]; k < split[share + 1]; k++) {
            const Task task = tasks[k];
            const int c0 = task.chunk * ATT_CHUNK;  // ranks [c0, c0 + ATT_CHUNK) of each token
            for (int h0 = task.g * group; h0 < (task.g + 1) * group; h0 += ATT_ROWS) {
                const int count = (task.g + 1) * group - h0 < ATT_ROWS ? (task.g + 1) * group - h0 : ATT_ROWS;
                const int per = batch->mask || ATT_PAIRS / count < 2 ? 1 : ATT_PAIRS / count;  // tokens per tile
                int ids[ATT_PAIRS], ends[ATT_PAIRS], tokens = 0;
                for (int j = task.j0; j <= task.j1; j++) {
                    if (j < task.j1 && seen[order[j]] > c0) {  // a token that sees the chunk
                        ids[tokens] = order[j];
                        ends[tokens++] = c0 + ATT_CHUNK < seen[order[j]] ? c0 + ATT_CHUNK : seen[order[j]];
                    }
                    if (tokens == 0 || (tokens < per && j < task.j1)) continue;
                    float* part[ATT_PAIRS];
                    for (int t = 0; t < tokens; t++)
                        for (int r = 0; r < count; r++)
                            part[t * count + r] = parts + (((size_t)ids[t] * heads + h0 + r) * chunks + task.chunk) * stride;
                    switch (tokens * count) {
#define VS_TASK(P) \
    case P: attention_task<P>(m, layer, batch, cache, q, q_stride, ids, tokens, h0, c0, ends, lo.data(), part); break;
                        VS_TASK(1) VS_TASK(2) VS_TASK(3) VS_TASK(4)
#if ATT_PAIRS > 4
                        VS_TASK(5) VS_TASK(6) VS_TASK(7) VS_TASK(8) VS_TASK(9) VS_TASK(10) VS_TASK(11) VS_TASK(12)
#endif
#undef VS_TASK
                    }
                    tokens = 0;
                }
            }
        }
    });
    parallel_for(n, threads, [&](int i) {
        for (int h = 0; h < heads; h++) {
            const float* first = parts + ((size_t)i * heads + h) * chunks * stride;
            float top = -INFINITY, total = 0.0f;
            for (int c = 0; c < chunks; c++) top = first[c * stride] > top ? first[c * stride] : top;
            float* o = out + (size_t)i * heads * hd + (size_t)h * hd;
            for (int d = 0; d < hd; d++) o[d] = 0.0f;
            for (int c = 0; c < chunks; c++) {
                const float* part = first + c * stride;
                if (part[0] == -INFINITY) continue;
                const float w = expf(part[0] - top);
                total += w * part[1];
                for (int d = 0; d < hd; d++) o[d] += w * part[2 + d];
            }
            const float inv = 1.0f / total;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
    });
    return 0;
}

// ------------------------------------------------------------------------------------------ repacking

// The 6-bit scale and minimum of sub-block i (of 8) of a Q4_K / Q5_K super-block's 12 scale bytes.
static inline void scale_min_k4(const uint8_t* s, int i, uint8_t* sc, uint8_t* mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 15) | (s[i - 4] >> 6) << 4;
        *mn = (s[i + 4] >> 4) | (s[i] >> 6) << 4;
    }
}

static inline uint16_t load16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// Block b (32 columns) of one row of GGUF blocks `row` of `format`: its unsigned integers u[32], and its
// scales (d, m: float16 bits of the block or its super-block; sc, sm: the K-quants' integer scales, two for
// Q6_K's halves).
static void unpack_block(int format, const uint8_t* row, int b, uint8_t* u, uint16_t* d, uint16_t* m, uint8_t* sc,
                         uint8_t* sm) {
    switch (format) {
        case VS_Q8_0: {
            const uint8_t* p = row + (size_t)b * 34;
            *d = load16(p);
            for (int j = 0; j < 32; j++) u[j] = (uint8_t)((int8_t)p[2 + j] + 128);
            return;
        }
        case VS_Q4_0:
        case VS_Q4_1:
        case VS_Q5_0:
        case VS_Q5_1: {
            const int minimum = format == VS_Q4_1 || format == VS_Q5_1, five = format == VS_Q5_0 || format == VS_Q5_1;
            const uint8_t* p = row + (size_t)b * (18 + 2 * minimum + 4 * five);
            *d = load16(p);
            if (minimum) *m = load16(p + 2);
            uint32_t qh = 0;
            if (five) memcpy(&qh, p + 2 + 2 * minimum, 4);
            const uint8_t* qs = p + 2 + 2 * minimum + 4 * five;
            for (int j = 0; j < 16; j++) {
                u[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
                u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
            }
            return;
        }
        case VS_Q4_K:
        case VS_Q5_K: {
            const int five = format == VS_Q5_K, i = b % 8;
            const uint8_t* p = row + (size_t)(b / 8) * (five ? 176 : 144);
            *d = load16(p);
            *m = load16(p + 2);
            scale_min_k4(p + 4, i, sc, sm);
            const uint8_t* qh = p + 16;
            const uint8_t* qs = p + 16 + 32 * five + 32 * (i / 2);
            for (int l = 0; l < 32; l++)
                u[l] = (uint8_t)(((qs[l] >> (4 * (i % 2))) & 15) | (five ? ((qh[l] >> i) & 1) << 4 : 0));
            return;
        }
        case VS_Q6_K: {
            const int i = b % 8, h = i / 4, k = i % 4;
            const uint8_t* p = row + (size_t)(b / 8) * 210;
            const uint8_t *ql = p + 64 * h + 32 * (k % 2), *qh = p + 128 + 32 * h;
            *d = load16(p + 208);
            sc[0] = p[192 + 2 * i];
            sc[1] = p[192 + 2 * i + 1];
            for (int l = 0; l < 32; l++) u[l] = (uint8_t)(((ql[l] >> (4 * (k / 2))) & 15) | ((qh[l] >> (2 * k)) & 3) << 4);
            return;
        }
    }
}

// GGUF blocks of a block-format matrix FMT, raw [rows, bytes per row], into the kernels' arrays of w (the
// layout group_view gives), allocated by the caller for rows padded to a multiple of VS_GROUP and zeroed
// (padding rows keep zero scales).
template <class FMT>
static void repack(const vs_matrix* w, const uint8_t* raw, size_t row_bytes, int threads) {
    const int nb = w->cols / QK, rows = w->rows;
    parallel_for((rows + VS_GROUP - 1) / VS_GROUP, threads, [&](int g) {
        const GroupView v = group_view<FMT>(w, g);  // the arrays' group g, written here
        uint8_t* q = (uint8_t*)v.q;
        uint16_t *d = (uint16_t*)v.d, *m = (uint16_t*)v.m;
        uint8_t *sc = (uint8_t*)v.sc, *sm = (uint8_t*)v.sm;
        for (int l = 0; l < VS_GROUP && g * VS_GROUP + l < rows; l++) {
            const uint8_t* row = raw + (size_t)(g * VS_GROUP + l) * row_bytes;
            for (int b = 0; b < nb; b++) {
                uint8_t u[32], s[2] = {0, 0}, mn = 0;
                uint16_t bd = 0, bm = 0;
                unpack_block(w->format, row, b, u, &bd, &bm, s, &mn);
                uint8_t* out = q + (size_t)b * FMT::CHUNKS * CHUNK + 4 * l;  // chunk 0, lane l
                if (FMT::BITS == 8) {
                    for (int c = 0; c < 8; c++) memcpy(out + (size_t)c * CHUNK, u + 4 * c, 4);
                } else {
                    for (int c = 0; c < 4; c++)
                        for (int j = 0; j < 4; j++) out[c * CHUNK + j] = (uint8_t)((u[4 * c + j] & 15) | (u[16 + 4 * c + j] & 15) << 4);
                    for (int bit = 4; bit < FMT::BITS; bit++)
                        for (int j = 0; j < 4; j++) {
                            uint8_t plane = 0;
                            for (int c = 0; c < 4; c++)
                                plane |= (uint8_t)(((u[4 * c + j] >> bit) & 1) << c | ((u[16 + 4 * c + j] >> bit) & 1) << (c + 4));
                            out[bit * CHUNK + j] = plane;
                        }
                }
                const size_t block = (size_t)b * VS_GROUP + l, super = (size_t)(b / 8) * VS_GROUP + l;
                if (FMT::SCALES == S_BLOCK) {
                    d[block] = bd;
                    if (FMT::MIN) m[block] = bm;
                } else if (FMT::SCALES == S_SUPER) {
                    d[super] = bd, m[super] = bm, sc[block] = s[0], sm[block] = mn;
                } else {  // S_HALVES
                    d[super] = bd, sc[2 * (size_t)b * VS_GROUP + l] = s[0], sc[(2 * (size_t)b + 1) * VS_GROUP + l] = s[1];
                }
            }
        }
    });
}

// The block-format matrix w's arrays from GGUF blocks (see repack). Returns 0, or -1 for a format without
// blocks.
extern "C" int vs_repack(const vs_matrix* w, const uint8_t* raw, size_t row_bytes, int threads) {
    switch (w->format) {
#define VS_FORMAT(CODE, FMT) \
    case CODE: repack<FMT>(w, raw, row_bytes, threads); return 0;
        VS_FORMAT(VS_Q8_0, FQ8_0) VS_FORMAT(VS_Q4_0, FQ4_0) VS_FORMAT(VS_Q4_1, FQ4_1) VS_FORMAT(VS_Q5_0, FQ5_0)
        VS_FORMAT(VS_Q5_1, FQ5_1) VS_FORMAT(VS_Q4_K, FQ4_K) VS_FORMAT(VS_Q5_K, FQ5_K) VS_FORMAT(VS_Q6_K, FQ6_K)
#undef VS_FORMAT
    }
    return -1;
}

// ------------------------------------------------------------------------------------------ entry points

// Quantize n rows of x [n, cols] (cols % 32 == 0) into q [n, cols], d, s, sums and lo [n, cols / 32], as
// the block formats' products do (exposed for tests).
extern "C" void vs_quantize_rows(int n, int cols, const float* x, int8_t* q, float* d, float* s, int32_t* sums,
                                 int32_t* lo) {
    for (int r = 0; r < n; r++)
        quantize_row(x + (size_t)r * cols, cols, q + (size_t)r * cols, d + (size_t)r * (cols / QK),
                     s + (size_t)r * (cols / QK), sums + (size_t)r * (cols / QK), lo + (size_t)r * (cols / QK));
}

// The outputs per group of the interleaved Q8_0 and Q4_1 layouts this build reads.
extern "C" int vs_group_size(void) { return VS_GROUP; }

// y [n, rows] = x [n, cols] W^T (+ bias). Returns 0, -1 for an invalid matrix, -2 when out of memory.
extern "C" int vs_matmul(const vs_matrix* w, int n, const float* x, float* y, int threads) {
    if (!valid_matrix(w) || n < 0) return -1;
    return matmul(w, n, x, y, threads);
}

// y [n, dim] = rmsnorm(x) * weight, normalising in float32 as transformers does.
extern "C" void vs_rmsnorm(int n, int dim, const float* x, const float* weight, float eps, float* y, int threads) {
    rmsnorm(n, dim, x, weight, eps, y, threads);
}

// Whether a stack's parts are valid matrices of `cols` columns and `rows` outputs in all.
static int valid_stack(const vs_stack* s, int rows, int cols) {
    if (s->count < 1 || s->count > VS_STACK) return 0;
    int total = 0;
    for (int p = 0; p < s->count; p++) {
        if (!valid_matrix(&s->part[p]) || s->part[p].cols != cols) return 0;
        total += s->part[p].rows;
    }
    return total == rows;
}

// The residual stream h [N, hidden] through layers [first, last) of `m`, writing every token's key and
// value into `cache` (see vs_batch). Returns 0, -1 for invalid arguments, -2 when out of memory.
extern "C" int vs_forward(const vs_model* m, int first, int last, const vs_batch* batch, const vs_cache* cache, float* h,
               int threads) {
    const int n = batch->n, hidden = m->hidden, hd = m->head_dim, half = hd / 2;
    if (first < 0 || last > m->num_layers || first > last || n <= 0 || hd % 2 || m->heads % m->kv_heads)
        return -1;
    for (int i = 0; i < n; i++) {
        if (batch->seq[i] < 0 || batch->seq[i] >= cache->batch || batch->slot[i] < batch->base[i] ||
            batch->slot[i] >= cache->capacity || batch->base[i] < 0)
            return -1;
        if (batch->mask && batch->slot[i] - batch->base[i] >= batch->mask_cols) return -1;
        if (cache->capacity % KT) return -1;
    }
    const int qkv_width = (m->heads + 2 * m->kv_heads) * hd, attn_width = m->heads * hd;
    const int inter = m->intermediate;
    for (int l = first; l < last; l++) {
        const vs_layer* L = &m->layers[l];
        if (!valid_stack(&L->qkv, qkv_width, hidden) || !valid_matrix(&L->o) ||
            !valid_stack(&L->gate_up, 2 * inter, hidden) || !valid_matrix(&L->down))
            return -1;
        if ((L->window > 0 && !batch->pos) || (L->local_rope && !(batch->cos_local && batch->sin_local))) return -1;
    }
    const int widest = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    float* x = (float*)thread_buffer(BUF_X, sizeof(float) * (size_t)n * hidden);
    float* wide = (float*)thread_buffer(BUF_WIDE, sizeof(float) * (size_t)n * widest);
    float* attn = (float*)thread_buffer(BUF_ATTN, sizeof(float) * (size_t)n * (attn_width > inter ? attn_width : inter));
    int status = x && wide && attn ? 0 : -2;
    for (int l = first; l < last && status == 0; l++) {
        const vs_layer* L = &m->layers[l];
        if (l == first)
            rmsnorm(n, hidden, h, L->attn_norm, m->eps, x, threads);
        else  // the last layer's MLP output joins the residual stream
            add_rmsnorm(n, hidden, h, x, L->attn_norm, m->eps, threads);
        status = matmul_stack(&L->qkv, n, x, wide, threads);  // wide: [N, qkv_width]
        if (status) break;
        parallel_for(n, threads, [&](int i) {  // q/k norms, RoPE on q and k; k and v into the cache (each its slot)
            float* row = wide + (size_t)i * qkv_width;
            const float* c = (L->local_rope ? batch->cos_local : batch->cos) + (size_t)i * half;
            const float* s = (L->local_rope ? batch->sin_local : batch->sin) + (size_t)i * half;
            for (int hh = 0; hh < m->heads + m->kv_heads; hh++) {
                const float* norm = hh < m->heads ? L->q_norm : L->k_norm;
                if (norm) rmsnorm_row(row + hh * hd, hd, norm, m->eps, row + hh * hd);
                rope(row + hh * hd, c, s, half);
            }
            const int slot = batch->slot[i];
            for (int g = 0; g < m->kv_heads; g++) {
                const size_t head = (((size_t)l * cache->batch + batch->seq[i]) * m->kv_heads + g) * cache->capacity * hd;
                uint16_t* ktile = cache->k + head + (size_t)(slot / KT) * hd * KT + slot % KT;
                uint16_t* v = cache->v + head + (size_t)slot * hd;
                const float *key = row + attn_width + g * hd, *value = row + attn_width + (m->kv_heads + g) * hd;
                for (int d = 0; d < hd; d++) {
                    ktile[d * KT] = fp32_to_fp16(key[d]);
                    v[d] = fp32_to_fp16(value[d]);
                }
            }
        });
        status = attention(m, l, batch, cache, wide, qkv_width, attn, threads);  // attn: [N, attn_width]
        if (status) break;
        status = matmul(&L->o, n, attn, x, threads);  // x: [N, hidden]
        if (status) break;
        if (L->post_attn_norm) rmsnorm(n, hidden, x, L->post_attn_norm, m->eps, x, threads);
        add_rmsnorm(n, hidden, h, x, L->mlp_norm, m->eps, threads);
        status = matmul_stack(&L->gate_up, n, x, wide, threads);  // wide: [N, 2 inter]
        if (status) break;
        parallel_for(n, threads, [&](int i) {  // act(gate) * up
            const float* gate = wide + (size_t)i * 2 * inter;
            gated(m->activation, gate, gate + inter, attn + (size_t)i * inter, inter);
        });
        status = matmul(&L->down, n, attn, x, threads);  // x: [N, hidden]
        if (status) break;
        if (L->post_mlp_norm) rmsnorm(n, hidden, x, L->post_mlp_norm, m->eps, x, threads);
    }
    if (status == 0 && last > first) add_rmsnorm(n, hidden, h, x, NULL, m->eps, threads);
    return status;
}

// A learned draft head's forward (EAGLE's): each token's input is [its embedding, feature] (inputs: the N
// tokens' embeddings [N, hidden] float32, features [N, hidden]) through fc [hidden, 2 hidden] (its bias included), every layer of
// `m` (keys and values into `cache`, see vs_batch) and the RMSNorm `norm` [hidden] into out [N, hidden];
// with `head` and `picks` [P], also logits [P, head rows] of the out rows picks[j] (out[picks] head^T). The
// same products, layers and norm as vs_matmul, vs_forward and vs_rmsnorm called one after another: a row's
// outputs depend on that row alone. Returns 0, -1 for invalid arguments, -2 when out of memory.
extern "C" int vs_draft(const vs_model* m, const vs_matrix* fc, const float* norm, const vs_matrix* head,
                        const float* inputs, const float* features, const vs_batch* batch, const vs_cache* cache,
                        float* out, int num_picks, const int32_t* picks, float* logits, int threads) {
    const int n = batch->n, hidden = m->hidden;
    if (n <= 0 || !valid_matrix(fc) || fc->rows != hidden || fc->cols != 2 * hidden) return -1;
    if (num_picks < 0 || (num_picks > 0 && (!head || !picks || !logits || !valid_matrix(head) || head->cols != hidden)))
        return -1;
    for (int j = 0; j < num_picks; j++)
        if (picks[j] < 0 || picks[j] >= n) return -1;
    float* in = (float*)thread_buffer(BUF_DRAFT, sizeof(float) * (size_t)(n > num_picks ? n : num_picks) * 2 * hidden);
    if (!in) return -2;
    for (int i = 0; i < n; i++) {  // in: [N, 2 hidden]
        memcpy(in + (size_t)i * 2 * hidden, inputs + (size_t)i * hidden, sizeof(float) * hidden);
        memcpy(in + ((size_t)i * 2 + 1) * hidden, features + (size_t)i * hidden, sizeof(float) * hidden);
    }
    int status = matmul(fc, n, in, out, threads);
    if (status == 0) status = vs_forward(m, 0, m->num_layers, batch, cache, out, threads);
    if (status) return status;
    rmsnorm(n, hidden, out, norm, m->eps, out, threads);
    if (num_picks == 0) return 0;
    for (int j = 0; j < num_picks; j++)  // in: [P, hidden], the picked rows
        memcpy(in + (size_t)j * hidden, out + (size_t)picks[j] * hidden, sizeof(float) * hidden);
    return matmul(head, num_picks, in, logits, threads);
}

// The index of the largest of x [n]: the first one, a NaN before any number (as torch's and NumPy's argmax).
static int argmax(const float* x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (!isnan(x[best]) && (isnan(x[i]) || x[i] > x[best])) best = i;
    return best;
}

// Greedy drafting with a learned draft head (see vs_draft), N rows at once, each on its own: row i reads
// inputs[i] (its token's embedding, inputs [N, hidden]) and features[i] at its cache row seq[i], slot slot[i],
// then steps[i] - 1 more tokens, each the draft vocabulary's argmax of the step before (vocab_rows [head rows,
// hidden]: each draft logit's token's embedding; ids [head rows]: its token id) read with that step's
// predicted feature at the next slot; drafts[i, s] (drafts [N, S], S = max steps) is the token the
// logits after step s give. cos and sin: [N, S, head_dim / 2], the RoPE of each row's step s. Every step is
// vs_draft's forward over the rows still drafting: a row's drafts depend on that row alone. Returns as
// vs_draft.
extern "C" int vs_draft_greedy(const vs_model* m, const vs_matrix* fc, const float* norm, const vs_matrix* head,
                               const float* vocab_rows, const int64_t* ids, int n, const float* inputs,
                               const float* features, const int32_t* seq, const int32_t* slot, const int32_t* steps,
                               const float* cos, const float* sin, const vs_cache* cache, int64_t* drafts, int threads) {
    const int hidden = m->hidden, half = m->head_dim / 2, rows = head ? head->rows : 0;
    if (n <= 0 || !head || !valid_matrix(head) || head->cols != hidden) return -1;
    int most = 0;
    for (int i = 0; i < n; i++) {
        if (steps[i] < 1) return -1;
        most = steps[i] > most ? steps[i] : most;
    }
    std::vector<float> emb(inputs, inputs + (size_t)n * hidden), feat(features, features + (size_t)n * hidden), out((size_t)n * hidden), logits((size_t)n * rows);
    std::vector<float> c((size_t)n * half), sn((size_t)n * half);
    std::vector<int32_t> s_seq(n), s_slot(n), picks(n);
    std::vector<int> active(n);
    for (int i = 0; i < n; i++) active[i] = i;
    for (int step = 0; step < most; step++) {
        const int a = (int)active.size();
        for (int j = 0; j < a; j++) {  // the rows still drafting, in order, packed
            const int i = active[j];
            s_seq[j] = seq[i], s_slot[j] = slot[i] + step, picks[j] = j;
            memcpy(&c[(size_t)j * half], cos + ((size_t)i * most + step) * half, sizeof(float) * half);
            memcpy(&sn[(size_t)j * half], sin + ((size_t)i * most + step) * half, sizeof(float) * half);
        }
        const vs_batch batch = {a, c.data(), sn.data(), s_seq.data(), s_slot.data(), s_slot.data(), NULL, 0, NULL, NULL, NULL};
        int status = vs_draft(m, fc, norm, head, emb.data(), feat.data(), &batch, cache, out.data(), a, picks.data(),
                              logits.data(), threads);
        if (status) return status;
        std::vector<int> going;
        for (int j = 0; j < a; j++) {
            const int i = active[j];
            const int best = argmax(&logits[(size_t)j * rows], rows);
            drafts[(size_t)i * most + step] = ids[best];
            if (step + 1 < steps[i]) {  // packed again for the next step
                memcpy(&emb[going.size() * hidden], vocab_rows + (size_t)best * hidden, sizeof(float) * hidden);
                memcpy(&feat[going.size() * hidden], &out[(size_t)j * hidden], sizeof(float) * hidden);
                going.push_back(i);
            }
        }
        active.assign(going.begin(), going.end());
    }
    return 0;
}

extern "C" int vs_abi_version(void) { return 6; }
