// The cooperative-lane scheduler behind the GPU emulations (tests/metal/shim/metal_stdlib, tests/cuda/shim): every
// thread of a threadgroup (Metal) or block (CUDA) is a fiber (ucontext), and a fiber yields only where the GPU lets
// lanes communicate, at a barrier or a SIMD/warp operation, so lanes interleave exactly there:
//   - barrier() waits for every thread of the group (one that returned first is a deadlock: an error) and can reduce a
//     predicate over them (CUDA's __syncthreads_or/_and/_count);
//   - simd_sync() gathers the active lanes of one SIMD group (Metal simdgroup, CUDA warp) at the same call; with
//     strict_simd (CUDA's full-mask *_sync operations) every lane of the warp must take part: one that returned or
//     waits at a barrier is an error, as the operation is undefined on the GPU;
//   - lanes run in a chosen order (0 forward, 1 reverse), and the caller poisons shared memory before each group, so a
//     read that a missing barrier leaves unordered sees poison or another order's value.
// What no emulation here models: the GPU compiler (fast math, contraction), timing, memory coalescing, and lanes of one
// SIMD group that diverge inside one operation (all lanes must reach the same call; checked).
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

namespace rq_fiber {

struct lane {
    ucontext_t ctx;
    char *     stack = nullptr;
    bool       done = false;
    bool       at_barrier = false;
    unsigned   tid  = 0;     // thread index in the group
};

struct group {
    std::vector<lane>             lanes;
    ucontext_t                    sched;
    int                           cur = -1;
    unsigned                      simd_width = 32;
    bool                          strict_simd = false;
    std::function<void(unsigned)> body;
    // barrier: generation, arrivals, and the predicate reduction of the current one
    unsigned bar_gen = 0, bar_count = 0;
    int      bar_or = 0, bar_and = 1, bar_sum = 0;
    int      res_or = 0, res_and = 1, res_sum = 0;
    unsigned long events = 0;   // arrivals at barriers and simd ops, completions, returns: progress
    // per SIMD group: a generation counter, arrivals, the value slots and which call each lane made
    std::vector<unsigned>      s_gen, s_count;
    std::vector<unsigned char> slots;      // [lanes][64]
    std::vector<const char *>  s_site;     // the simd op each arrived lane called (divergence check)
};

inline group *      G = nullptr;
inline const char * emu_name = "GPU emulation";
inline const char * barrier_name = "barrier";  // as the kernels spell it, for the messages
inline size_t       stack_bytes = 256*1024;

[[noreturn]] inline void fail(const char * what) {
    fprintf(stderr, "%s: %s\n", emu_name, what);
    exit(3);
}

inline lane & me() { return G->lanes[G->cur]; }

inline void yield() { swapcontext(&me().ctx, &G->sched); }

inline void trampoline() {
    G->body(me().tid);
    me().done = true;
    G->events++;
    swapcontext(&me().ctx, &G->sched);
}

// a lane takes part in its SIMD group's current operation unless it returned or waits at a barrier (it left the
// branch the operation is in: lanes outside a divergent branch are inactive on the GPU too)
inline bool simd_active(unsigned t) { return !G->lanes[t].done && !G->lanes[t].at_barrier; }

inline unsigned simd_first(unsigned sg) { return sg*G->simd_width; }
inline unsigned simd_end(unsigned sg) { return (unsigned) std::min<size_t>((sg + 1)*G->simd_width, G->lanes.size()); }

inline unsigned active_in_simd(unsigned sg) {
    unsigned n = 0;
    for (unsigned t = simd_first(sg); t < simd_end(sg); ++t) {
        n += simd_active(t);
    }
    return n;
}

// all active lanes of this lane's SIMD group arrive at the same call; the last to make the count complete it (a lane
// that reaches a barrier meanwhile can complete it for the waiters: they re-check on every resumption)
inline void simd_sync(const char * site) {
    const unsigned sg  = me().tid / G->simd_width;
    const unsigned gen = G->s_gen[sg];
    G->s_site[me().tid] = site;
    G->s_count[sg]++;
    G->events++;
    while (G->s_gen[sg] == gen) {
        if (G->strict_simd) {
            for (unsigned t = simd_first(sg); t < simd_end(sg); ++t) {
                if (G->lanes[t].done) {
                    fail("a warp operation with the full mask after a lane of the warp returned (undefined on the GPU)");
                }
                if (G->lanes[t].at_barrier) {
                    fail("a warp operation with the full mask while a lane of the warp waits at __syncthreads");
                }
            }
        }
        if (G->s_count[sg] == active_in_simd(sg)) {
            for (unsigned t = simd_first(sg); t < simd_end(sg); ++t) {
                if (simd_active(t) && G->s_site[t] != site) {
                    fail("lanes of one SIMD group are in different SIMD operations (divergent control flow)");
                }
            }
            G->s_count[sg] = 0;
            G->s_gen[sg]++;
            G->events++;
            return;
        }
        yield();
    }
}

// every thread of the group waits here; returns the OR, AND and count of pred over them (in *out, when given)
inline void barrier(int pred = 0, int * out_or = nullptr, int * out_and = nullptr, int * out_sum = nullptr) {
    const unsigned gen = G->bar_gen;
    G->events++;
    G->bar_or  |= pred != 0;
    G->bar_and &= pred != 0;
    G->bar_sum += pred != 0;
    if (++G->bar_count == G->lanes.size()) {
        G->res_or = G->bar_or; G->res_and = G->bar_and; G->res_sum = G->bar_sum;
        G->bar_or = 0; G->bar_and = 1; G->bar_sum = 0;
        G->bar_count = 0;
        G->bar_gen++;
        for (lane & l : G->lanes) {
            l.at_barrier = false;   // released now, whenever the scheduler resumes them
        }
    } else {
        me().at_barrier = true;
        while (G->bar_gen == gen) {
            for (const lane & l : G->lanes) {
                if (l.done) {
                    char msg[128];
                    snprintf(msg, sizeof(msg), "a thread returned while others wait at a %s", barrier_name);
                    fail(msg);
                }
            }
            yield();
        }
    }
    // the results stay until the next barrier completes, which needs this thread again
    if (out_or)  *out_or  = G->res_or;
    if (out_and) *out_and = G->res_and;
    if (out_sum) *out_sum = G->res_sum;
}

// the stacks, kept for the whole run (allocating them per group costs more than the kernels) and never freed: fail()
// exits from a fiber, on one of them
inline char * lane_stack(unsigned t) {
    static auto * stacks = new std::vector<std::vector<char>>();
    if (stacks->size() <= t) {
        stacks->resize(t + 1);
    }
    if ((*stacks)[t].size() != stack_bytes) {
        (*stacks)[t].assign(stack_bytes, 0);
    }
    return (*stacks)[t].data();
}

// runs every group of the grid; fn(group, tid) is one thread's kernel call; order 0: lanes forward, 1: reverse;
// before_group(group) runs before the group's first lane (the caller poisons shared memory there)
inline void dispatch(unsigned n_groups, unsigned threads, const std::function<void(unsigned group, unsigned tid)> & fn,
                     int order, unsigned simd_width, bool strict_simd,
                     const std::function<void(unsigned group)> & before_group = nullptr) {
    for (unsigned gi = 0; gi < n_groups; ++gi) {
        group g;
        g.simd_width  = simd_width;
        g.strict_simd = strict_simd;
        g.lanes.resize(threads);
        const unsigned n_sg = (threads + simd_width - 1)/simd_width;
        g.s_gen.assign(n_sg, 0);
        g.s_count.assign(n_sg, 0);
        g.slots.assign(threads*64, 0);
        g.s_site.assign(threads, nullptr);
        g.body = [&](unsigned tid) { fn(gi, tid); };
        if (before_group) {
            before_group(gi);
        }
        G = &g;
        for (unsigned t = 0; t < threads; ++t) {
            lane & l = g.lanes[t];
            l.tid   = t;
            l.stack = lane_stack(t);
            getcontext(&l.ctx);
            l.ctx.uc_stack.ss_sp   = l.stack;
            l.ctx.uc_stack.ss_size = stack_bytes;
            l.ctx.uc_link = nullptr;
            makecontext(&l.ctx, trampoline, 0);
        }
        for (;;) {
            bool any = false;
            const unsigned long ev = g.events;
            for (unsigned k = 0; k < threads; ++k) {
                const unsigned t = order == 0 ? k : threads - 1 - k;
                if (g.lanes[t].done) {
                    continue;
                }
                any = true;
                g.cur = (int) t;
                swapcontext(&g.sched, &g.lanes[t].ctx);
            }
            if (!any) {
                break;
            }
            // a pass in which no lane arrived anywhere, completed an operation or returned: nothing ever will
            if (g.events == ev) {
                fail("deadlock: threads wait at a barrier or SIMD operation that others never reach");
            }
        }
        G = nullptr;
    }
}

// the value slots of a SIMD exchange: each lane writes its value, all sync, each reads the one it asked for
template <typename T> inline T simd_read(unsigned tid, bool & ok) {
    T r;
    ok = tid < G->lanes.size() && simd_active(tid);
    if (!ok) {
        memset((void *) &r, 0xff, sizeof(T));   // an inactive lane: undefined on the GPU, NaN bits here
        return r;
    }
    memcpy((void *) &r, &G->slots[tid*64], sizeof(T));
    return r;
}

template <typename T> inline T simd_exchange(T v, const char * site, unsigned src_of_me) {
    static_assert(sizeof(T) <= 64, "simd value too large");
    const unsigned tid = me().tid;
    memcpy(&G->slots[tid*64], &v, sizeof(T));
    simd_sync(site);
    bool ok;
    const T r = simd_read<T>(src_of_me, ok);
    simd_sync(site);   // nobody overwrites a slot before every lane has read
    return r;
}

} // namespace rq_fiber
