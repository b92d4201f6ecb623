// Relaxed atomics for our counters and switches without C11's <stdatomic.h> and _Atomic, which MSVC's C
// compiler lacks: the GCC/Clang __atomic builtins on plain integers, the Interlocked intrinsics on MSVC (the
// same split as ggml-cpu.c's own atomics). Only relaxed order is needed: each value stands alone.
#pragma once

#include <stdint.h>

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
typedef volatile long    rq_atomic_int;  // long is 32 bits on Windows
typedef volatile int64_t rq_atomic_u64;
static __inline int      rq_atomic_load_int (rq_atomic_int * p)             { return (int) _InterlockedOr(p, 0); }
static __inline void     rq_atomic_store_int(rq_atomic_int * p, int v)      { _InterlockedExchange(p, (long) v); }
static __inline uint64_t rq_atomic_load_u64 (rq_atomic_u64 * p)             { return (uint64_t) _InterlockedOr64(p, 0); }
static __inline void     rq_atomic_store_u64(rq_atomic_u64 * p, uint64_t v) { _InterlockedExchange64(p, (int64_t) v); }
static __inline void     rq_atomic_add_u64  (rq_atomic_u64 * p, uint64_t n) { _InterlockedExchangeAdd64(p, (int64_t) n); }
#else
typedef int      rq_atomic_int;
typedef uint64_t rq_atomic_u64;
static inline int      rq_atomic_load_int (rq_atomic_int * p)             { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void     rq_atomic_store_int(rq_atomic_int * p, int v)      { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline uint64_t rq_atomic_load_u64 (rq_atomic_u64 * p)             { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void     rq_atomic_store_u64(rq_atomic_u64 * p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline void     rq_atomic_add_u64  (rq_atomic_u64 * p, uint64_t n) { __atomic_fetch_add(p, n, __ATOMIC_RELAXED); }
#endif
