/* The CPU path's paged decode attention, compiled with elementwise.c into one
   library by native.py and called from decode_native.py, which checks what the C
   code trusts.

   Torch can only attend over paged K/V by first gathering each sequence's
   blocks into a dense copy (every layer, every step) and reading the copy
   again; this reads K and V once, straight from the blocks the table names
   (with a sliding window, only the window's): the scores of all query heads
   of a position (GQA: head h reads KV head h // group), a softmax per head
   (with its sink's column when there are sinks, gpt-oss), the weighted sum
   of V. The blocks lie anywhere in the cache, where the hardware's prefetchers
   (which stop at page boundaries) do not follow: the next block's K and each
   position's V are asked for ahead of their use, which took a step's decode
   attention from ~420 to ~250 us a layer on tiny (most of its K/V comes from
   memory, not cache). The softmax's exponentials are taken eight at a time
   (exp8, exp8.h). When a step has enough K/V to read, its rows are taken one at a time
   by the calling thread and up to torch's thread count - 1 helpers, from a
   pool that lives as long as the process and sleeps between calls (threads
   started per call cost ~30 us each, and on a busy machine wait to be
   scheduled); a row is done by one thread, so results do not depend on the
   thread count, and a helper not yet scheduled takes no row and is not waited
   for. */

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* q (S, H, D) fp32 with row/head strides, unit stride in D; k/v caches contiguous
   (num_blocks, BS, HK, D), fp32 or bf16 (kv_bf16: the upper 16 bits of an fp32, as
   torch stores it; widened to fp32 as read, every sum in fp32); tables (S, >= ceil(ctx
   / BS)) int32 rows; lens (S,) int32; out (S, H, D) fp32 contiguous. */
typedef struct {
    const float *q; int64_t q_stride_s, q_stride_h;
    const void *k_cache, *v_cache; int kv_bf16;
    const int32_t *tables; int64_t table_stride; const int32_t *lens;
    float *out; int64_t S, H, HK, D, BS; float scale; int64_t max_len;
    int64_t window; float softcap; /* 0: no sliding window, no soft-capping */
    const float *sinks; /* (H,) per-head sink logits, or NULL */
} Decode;

/* The cache lines of one position's K or V (n bytes), asked for ahead of their use:
   blocks lie anywhere in the cache, where the hardware's prefetchers do not follow.
   K is read one block later, V only after all of the row's scores, both into L2.
   K was once asked for non-temporally (to keep it out of the outer caches, where the
   weights the matmuls read next are): those prefetches waited on the core's few fill
   buffers, under 56% of the kernel's samples (perf), and asking into L2 took tiny's
   whole run 1.18x less CPU (small's 1.01x; benchmarks in that commit's message). */
static inline void prefetch(const char *at, int64_t n)
{
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(at + i, 0, 2);
}

/* Element d of a K/V row as fp32: a bf16 is the upper half of its fp32. */
static inline float kv_at(const void *row, int64_t d, const int is_bf16)
{
    return is_bf16 ? bf16_load(((const bf16_t *)row)[d]) : ((const float *)row)[d];
}

/* out[0 .. V_CHUNK) = sum over p in [lo, n) of w[p] * V[p][at .. at + V_CHUNK), in p's
   order from 0, as the position-by-position loop below adds into the zeroed output (the
   same sums, bit for bit): the chunk stays in registers over the positions instead of
   being loaded and stored at each, which took that loop most of the kernel's time. V's
   rows are found a block at a time. */
enum { V_CHUNK = 32 };
static inline __attribute__((always_inline)) void weigh_chunk(
    const Decode *a, const int32_t *table, const float *w, int64_t lo, int64_t n, int64_t at,
    float *out, const int bf16)
{
    const int64_t BS = a->BS, row = a->HK * a->D, size = bf16 ? 2 : 4;
    float acc[V_CHUNK] = {0.f};
    for (int64_t p = lo; p < n;) {
        const int64_t end = (p / BS + 1) * BS < n ? (p / BS + 1) * BS : n;
        const char *v = (const char *)a->v_cache + ((int64_t)table[p / BS] * BS + p % BS) * row * size
                        + at * size;
        for (; p < end; p++, v += row * size) {
            const float wp = w[p];
            #pragma omp simd
            for (int64_t d = 0; d < V_CHUNK; d++) acc[d] += wp * kv_at(v, d, bf16);
        }
    }
    for (int64_t d = 0; d < V_CHUNK; d++) out[d] = acc[d];
}

/* One row s; scores: H * max_len + H floats of scratch. Inlined into one copy per
   K/V type (bf16 a constant there), so the inner loops vectorise for each. */
static inline __attribute__((always_inline)) void decode_row_as(
    const Decode *a, int64_t s, float *scores, const int bf16)
{
    const int64_t H = a->H, D = a->D, BS = a->BS, group = H / a->HK;
    const int64_t row = a->HK * D; /* elements from one position to the next */
    const int64_t size = bf16 ? 2 : 4, row_bytes = row * size;
    const char *k_cache = a->k_cache, *v_cache = a->v_cache;
    float *top = scores + H * a->max_len;
    const int64_t n = a->lens[s];
    const int32_t *table = a->tables + s * a->table_stride;
    const float *qs = a->q + s * a->q_stride_s;
    float *o = a->out + s * H * D;
    for (int64_t i = 0; i < H * D; i++) o[i] = 0.f;
    if (n == 0) return; /* a padding row attends to nothing: zeros */
    /* the query sits at n - 1 and, with a window, sees keys n - window .. n - 1 */
    const int64_t lo = (a->window > 0 && n > a->window) ? n - a->window : 0;
    for (int64_t h = 0; h < H; h++) top[h] = -INFINITY;
    for (int64_t p = lo; p < n; p++) { /* scores: K read once, every head of a position together */
        const int64_t at = ((int64_t)table[p / BS] * BS + p % BS) * row_bytes;
        const char *k = k_cache + at;
        if (p + BS < n) /* the next block's K is on its way while this block is read */
            prefetch(k_cache + ((int64_t)table[(p + BS) / BS] * BS + p % BS) * row_bytes, row_bytes);
        prefetch(v_cache + at, row_bytes); /* and this position's V, for the sum below */
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qs + h * a->q_stride_h;
            const char *kh = k + (h / group) * D * size;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; d++) dot += qh[d] * kv_at(kh, d, bf16);
            dot *= a->scale;
            if (a->softcap > 0.f) dot = a->softcap * tanhf(dot / a->softcap);
            scores[h * n + p] = dot;
            if (dot > top[h]) top[h] = dot;
        }
    }
    for (int64_t h = 0; h < H; h++) { /* softmax per head, with its sink's column */
        float sum = 0.f, *sh = scores + h * n;
        if (a->sinks && a->sinks[h] > top[h]) top[h] = a->sinks[h];
        int64_t p = lo;
        v8 sums = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (; p + 8 <= n; p += 8) { /* eight at a time: libm's expf one by one took longer */
            v8 e;
            memcpy(&e, sh + p, sizeof e);
            e = exp8(e - top[h]);
            memcpy(sh + p, &e, sizeof e);
            sums += e;
        }
        for (int i = 0; i < 8; i++) sum += sums[i];
        for (; p < n; p++) { sh[p] = expf(sh[p] - top[h]); sum += sh[p]; }
        if (a->sinks) sum += expf(a->sinks[h] - top[h]);
        const float inv = 1.f / sum;
        for (int64_t p = lo; p < n; p++) sh[p] *= inv;
    }
    if (D % V_CHUNK == 0) { /* weighted sum, V_CHUNK of a head's outputs held in registers */
        for (int64_t h = 0; h < H; h++)
            for (int64_t d0 = 0; d0 < D; d0 += V_CHUNK)
                weigh_chunk(a, table, scores + h * n, lo, n, (h / group) * D + d0, o + h * D + d0, bf16);
        return;
    }
    for (int64_t p = lo; p < n; p++) { /* weighted sum: V read once */
        const char *v = v_cache + ((int64_t)table[p / BS] * BS + p % BS) * row_bytes;
        for (int64_t h = 0; h < H; h++) {
            const float w = scores[h * n + p];
            const char *vh = v + (h / group) * D * size;
            float *oh = o + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += w * kv_at(vh, d, bf16);
        }
    }
}

static void decode_row_f32(const Decode *a, int64_t s, float *scores) { decode_row_as(a, s, scores, 0); }
static void decode_row_bf16(const Decode *a, int64_t s, float *scores) { decode_row_as(a, s, scores, 1); }

static void decode_row(const Decode *a, int64_t s, float *scores)
{
    if (a->kv_bf16) decode_row_bf16(a, s, scores);
    else decode_row_f32(a, s, scores);
}

/* A pool of helper threads that lives as long as the process, started as calls ask
   for them. A call publishes its rows as job number `generation`; the caller and the
   helpers it woke take rows one at a time from `ticket` (generation << 32 | next row),
   so a helper the scheduler has not run yet takes none and is never waited for: the
   caller waits only for rows taken and not yet done. A row is done by one thread
   whatever the thread count, so results do not depend on it. Helpers sleep on a
   condition variable between jobs (no spinning against other work). */
enum { MAX_HELPERS = 63 };
static struct {
    pthread_mutex_t lock; /* guards generation, helpers, started; the waits */
    pthread_cond_t wake, finished;
    uint32_t generation;
    int64_t helpers; /* helpers the current job wants */
    int64_t started;
    Decode job; /* the current job, as the caller published it under the lock */
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    _Atomic int status; /* 1 once a thread found no memory for its scores */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
            .finished = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;

/* Takes and does rows of job `generation` (`job`, as it was when it was published)
   until none is left. A row taken below S is not done yet, so the job, and what its
   pointers point at, are still there. */
static void take_rows(const Decode *job, uint32_t generation)
{
    float *scores = NULL;
    uint64_t ticket = atomic_load(&pool.ticket);
    while ((uint32_t)(ticket >> 32) == generation && (int64_t)(ticket & 0xffffffffu) < job->S) {
        if (!atomic_compare_exchange_weak(&pool.ticket, &ticket, ticket + 1)) continue;
        if (!scores)
            scores = malloc(sizeof(float) * (size_t)(job->H * (job->max_len > 0 ? job->max_len : 1) + job->H));
        if (scores) decode_row(job, (int64_t)(ticket & 0xffffffffu), scores);
        else atomic_store(&pool.status, 1);
        if (atomic_fetch_add(&pool.done, 1) + 1 == job->S) { /* the caller may be waiting */
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
        ticket = atomic_load(&pool.ticket);
    }
    free(scores);
}

static void *helper(void *arg)
{
    const int64_t index = (int64_t)(intptr_t)arg;
    uint32_t seen = 0; /* no job has generation 0 */
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (index >= pool.helpers) continue;
        const Decode job = pool.job;
        pthread_mutex_unlock(&pool.lock);
        take_rows(&job, seen);
        pthread_mutex_lock(&pool.lock);
    }
    return NULL;
}

/* A forked child has none of the helpers (nor, maybe, an unlocked lock): starts afresh. */
static void forget_pool(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pthread_mutex_init(&caller, NULL);
    pool.started = 0;
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_pool); }

/* Rows of the step over this thread and up to threads - 1 helpers; K/V fp32, or bf16
   where kv_bf16 is 1. Returns 0, or 1 when out of memory. */
int paged_decode_attention(
    const float *q, int64_t q_stride_s, int64_t q_stride_h,
    const void *k_cache, const void *v_cache, int64_t kv_bf16,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    float *out, int64_t S, int64_t H, int64_t HK, int64_t D, int64_t BS,
    float scale, int64_t max_len, int64_t window, float softcap, const float *sinks,
    int64_t threads)
{
    const Decode job = {q, q_stride_s, q_stride_h, k_cache, v_cache, kv_bf16 != 0, tables, table_stride,
                        lens, out, S, H, HK, D, BS, scale, max_len, window, softcap, sinks};
    int64_t helpers = threads - 1 < S - 1 ? threads - 1 : S - 1;
    if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
    if (helpers < 1 || S >= 0xffffffffLL || pthread_mutex_trylock(&caller) != 0) {
        /* alone: one thread asked, one row, or another thread's job holds the pool */
        float *scores = malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1) + H));
        if (!scores) return 1;
        for (int64_t s = 0; s < S; s++) decode_row(&job, s, scores);
        free(scores);
        return 0;
    }
    pthread_once(&fork_handler, watch_forks);
    pthread_mutex_lock(&pool.lock);
    while (pool.started < helpers) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&id, &attr, helper, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers: the rows are taken by those there are */
        pool.started++;
    }
    pool.job = job;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.status, 0);
    if (++pool.generation == 0) pool.generation = 1;
    const uint32_t generation = pool.generation;
    pool.helpers = helpers;
    atomic_store(&pool.ticket, (uint64_t)generation << 32);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_rows(&job, generation);
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.done) < S) pthread_cond_wait(&pool.finished, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    const int status = atomic_load(&pool.status);
    pthread_mutex_unlock(&caller);
    return status;
}
