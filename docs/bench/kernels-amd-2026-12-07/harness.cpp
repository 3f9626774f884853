// The product's cost by activation row count, outside Python: #include (a variant of) the kernels' cpu.cpp and
// time matmul() of n = 1 .. 16 rows against `mats` matrices [rows, 2048] of random blocks in the kernels'
// packed layout. Per n: milliseconds, and cycles per block-row (16 outputs x 32 columns against one row, at
// 3.65 GHz, the clock a dependent-add loop measured). Build and run from the repository root:
//   g++ -O3 -std=c++17 -fopenmp -pthread -march=native -w \
//       -DKERNEL='"../../../src/verispec/kernels/cpu.cpp"' docs/bench/kernels-amd-2026-12-07/harness.cpp -o harness
//   ./harness 7            # Q4_K, 12 x [8192, 2048] (113 MB: from memory), 2 threads
//   ./harness 7 512 1 1    # Q4_K, one [512, 2048] matrix (in L2), 1 thread: compute alone
//   HUGE=1 ./harness 7     # the weights in transparent huge pages (madvise)
#include KERNEL
#include <random>
#include <vector>
#include <cstdio>
#include <sys/mman.h>
template<class T> struct HugeAlloc { typedef T value_type; HugeAlloc()=default; template<class U> HugeAlloc(const HugeAlloc<U>&){} T* allocate(size_t n){ size_t b=(n*sizeof(T)+(2<<20)-1)&~size_t((2<<20)-1); void* p=aligned_alloc(2<<20,b); if(getenv("HUGE")) madvise(p,b,MADV_HUGEPAGE); return (T*)p;} void deallocate(T* p,size_t){free(p);} };
template<class T, class U> bool operator==(const HugeAlloc<T>&, const HugeAlloc<U>&){return true;}
template<class T, class U> bool operator!=(const HugeAlloc<T>&, const HugeAlloc<U>&){return false;}
int main(int argc, char** argv) {
    const int rows = argc > 2 ? atoi(argv[2]) : 8192, cols = 2048, mats = argc > 3 ? atoi(argv[3]) : 12, threads = argc > 4 ? atoi(argv[4]) : 2;
    int format = argc > 1 ? atoi(argv[1]) : VS_Q4_K;
    std::mt19937 rng(1);
    const int nb = cols / QK, groups = rows / VS_GROUP;
    int chunks = format == VS_Q8_0 ? 8 : format == VS_Q6_K ? 6 : format == VS_Q5_K || format == VS_Q5_0 || format == VS_Q5_1 ? 5 : 4;
    bool super = format == VS_Q4_K || format == VS_Q5_K || format == VS_Q6_K;
    int per = super ? nb / 8 : nb;
    std::vector<vs_matrix> W(mats);
    std::vector<std::vector<uint8_t, HugeAlloc<uint8_t>>> store;
    for (int i = 0; i < mats; i++) {
        store.emplace_back((size_t)groups * nb * chunks * CHUNK);
        for (auto& b : store.back()) b = rng();
        store.emplace_back((size_t)groups * per * VS_GROUP * 2);
        { uint16_t* d = (uint16_t*)store.back().data(); for (size_t k = 0; k < store.back().size() / 2; k++) d[k] = 0x1c00 + (rng() & 0x3ff); }
        store.emplace_back((size_t)groups * per * VS_GROUP * 2);
        { uint16_t* d = (uint16_t*)store.back().data(); for (size_t k = 0; k < store.back().size() / 2; k++) d[k] = 0x1c00 + (rng() & 0x3ff); }
        store.emplace_back((size_t)groups * nb * VS_GROUP * 2);
        for (auto& b : store.back()) b = rng() & 63;
        store.emplace_back((size_t)groups * nb * VS_GROUP);
        for (auto& b : store.back()) b = rng() & 63;
        size_t k = store.size() - 5;
        W[i] = {format, rows, cols, store[k].data(), (uint16_t*)store[k + 1].data(), (uint16_t*)store[k + 2].data(),
                store[k + 3].data(), store[k + 4].data(), NULL};
        if (!super) { W[i].sc = NULL; W[i].sm = NULL; }
        if (format == VS_Q6_K) W[i].sm = NULL;
        if (format == VS_Q8_0 || format == VS_Q4_0 || format == VS_Q5_0 || format == VS_Q6_K) W[i].m = NULL;
    }
    const int NS[] = {1, 2, 3, 4, 6, 8, 16};
    std::vector<float> x(16 * cols), y(16 * rows);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(rng);
    double t1 = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int n : NS) {
            double best = 1e9;
            for (int rep = 0; rep < (mats < 4 ? 200 : 9); rep++) {
                auto t = std::chrono::steady_clock::now();
                for (int i = 0; i < mats; i++) matmul(&W[i], n, x.data(), y.data(), threads);
                best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
            }
            if (n == 1) t1 = best;
            if (pass == 1) printf("%d:%.2fms/%.1fc%s", n, best * 1e3, best * 3.65e9 * threads / ((double)mats * groups * nb * n), n == 16 ? "\n" : " ");
            
        }
    }
    double s = 0; for (int i = 0; i < 16 * rows; i++) s += y[i];
    fprintf(stderr, "checksum %.6g\n", s);
}
