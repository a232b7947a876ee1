/* The integer matmul's thread pool (qmatmul.h): one for the whole step, its matmuls and, through
q8_parallel, row_ops.c's layer loop. */
#include "qmatmul.h"

/* ---- the thread pool ----
   A call is split into parts that threads claim: the caller claims too, so a part a worker never
   got to (its core busy with another process, or asleep) is run by the caller, which then waits
   only for the parts workers did claim. */

#define MAX_THREADS 256
#define SPIN_NS 100000  /* a worker spins this long for the next call, then sleeps */

static struct {
    pthread_mutex_t call;  /* one caller at a time */
    pthread_mutex_t lock;  /* guards sleeping workers */
    pthread_cond_t wake;
    int threads;           /* including the caller; 0 before the first call */
    pid_t pid;             /* threads do not survive fork: a child starts its own */
    pthread_t ids[MAX_THREADS];
    atomic_uint generation;  /* of the call in flight */
    unsigned started;      /* the generation when the workers were started */
    atomic_ullong claims;  /* generation << 32 | parts claimed so far */
    atomic_int parts;
    atomic_int done;       /* parts finished by workers */
    int quit;
    task_fn fn;
    void *ctx;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next unclaimed part of call `generation`, or -1 when it has none left or is over. */
static int claim(unsigned generation) {
    unsigned long long c = atomic_load_explicit(&pool.claims, memory_order_acquire);
    for (;;) {
        if ((unsigned)(c >> 32) != generation || (int)(c & 0xffffffffu) >= atomic_load(&pool.parts)) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool.claims, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            return (int)(c & 0xffffffffu);
    }
}

static void *worker(void *arg) {
    (void)arg;
    unsigned seen = pool.started;  /* not the current one: the first call may come before this runs */
    for (;;) {
        int64_t deadline = now_ns() + SPIN_NS;
        unsigned spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 64 || now_ns() < deadline) continue;
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (pool.quit) return NULL;
        for (int part; (part = claim(seen)) >= 0;) {
            pool.fn(pool.ctx, part, atomic_load(&pool.parts));
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
}

static unsigned publish(task_fn fn, void *ctx, int parts) {
    unsigned generation = atomic_load(&pool.generation) + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.parts, parts);
    atomic_store(&pool.done, 0);
    atomic_store_explicit(&pool.claims, (unsigned long long)generation << 32, memory_order_release);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.generation, generation, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    return generation;
}

static void resize_pool(int threads) {
    if (pool.threads > 1 && pool.pid == getpid()) {
        pool.quit = 1;
        publish(NULL, NULL, 0);
        for (int i = 1; i < pool.threads; i++) pthread_join(pool.ids[i], NULL);
        pool.quit = 0;
    }
    pool.threads = 1;
    pool.pid = getpid();
    pool.started = atomic_load(&pool.generation);
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&pool.ids[i], NULL, worker, NULL)) break;
        pool.threads = i + 1;
    }
}

void run_parallel(int threads, task_fn fn, void *ctx) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    pthread_mutex_lock(&pool.call);
    if (pool.threads != threads || pool.pid != getpid()) resize_pool(threads);
    int parts = pool.threads, mine = 0;
    if (parts == 1) {
        fn(ctx, 0, 1);
    } else {
        unsigned generation = publish(fn, ctx, parts);
        for (int part; (part = claim(generation)) >= 0; mine++) fn(ctx, part, parts);
        unsigned spins = 0;
        while (atomic_load_explicit(&pool.done, memory_order_acquire) < parts - mine)
            if (++spins % 1024) cpu_relax(); else sched_yield();  /* a worker may have lost its core */
    }
    pthread_mutex_unlock(&pool.call);
}

/* run_parallel for other native code (row_ops.c's layer loop): one pool for the whole step. */
void q8_parallel(int threads, task_fn fn, void *ctx) { run_parallel(threads, fn, ctx); }

int clamped_threads(int threads) { return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads; }
