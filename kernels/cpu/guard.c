/* The device-memory guard of the CPU backend (CONFIG_CPU_DEVICE_GUARD).
 *
 * On a GPU, device memory is out of the host's reach; on the CPU it is
 * ordinary memory, so model code that reads or writes it with host code
 * works here by accident and fails on a GPU. In this mode dev_alloc hands out
 * page-aligned mappings that stay PROT_NONE except while a function of the
 * backend runs: kernels/cpu/ is compiled with -finstrument-functions, and
 * the hooks below count how deep the program is inside the backend (across
 * the OpenMP threads of a kernel). Entering from outside opens every buffer,
 * leaving closes them again (the buffers share one reserved range of address
 * space: one mprotect call each way). A host access from outside faults, and
 * the SIGSEGV handler names the buffer and prints the call stack.
 *
 * Slower than the plain backend (two system calls per backend call, whose
 * cost grows with the memory in use): for tests of small models and for
 * checking new model code, never for measurements. */
#define _GNU_SOURCE
#include "guard.h"

#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

#define NOINST __attribute__((no_instrument_function))

/* All guarded buffers live in one reserved range of address space, so that
 * opening and closing them is one mprotect call each over [base, top). */
#define ARENA_BYTES ((size_t)1 << 38) /* 256 GiB of address space, reserved, not committed */

typedef struct {
    size_t off, len;  /* in the arena: whole pages */
    size_t bytes;     /* asked for */
    int used;
} Block;

static char *g_base;
static size_t g_top; /* bytes of the arena handed out so far (high water) */
static Block *g_blocks;
static int g_n, g_cap;
static int g_depth; /* how deep inside backend functions (atomic: OpenMP threads enter too) */

static NOINST void protect_all(int prot) {
    if (g_top && mprotect(g_base, g_top, prot) != 0) FATAL("device guard: mprotect of %zu bytes failed", g_top);
}

NOINST void __cyg_profile_func_enter(void *fn, void *site) {
    (void)fn, (void)site;
    if (__atomic_fetch_add(&g_depth, 1, __ATOMIC_ACQ_REL) == 0) protect_all(PROT_READ | PROT_WRITE);
}

NOINST void __cyg_profile_func_exit(void *fn, void *site) {
    (void)fn, (void)site;
    if (__atomic_sub_fetch(&g_depth, 1, __ATOMIC_ACQ_REL) == 0) protect_all(PROT_NONE);
}

static NOINST void on_fault(int sig, siginfo_t *info, void *uctx) {
    (void)uctx;
    char *addr = info->si_addr;
    for (int i = 0; g_base && addr >= g_base && addr < g_base + g_top && i < g_n; i++) {
        Block *k = &g_blocks[i];
        if (k->used && addr >= g_base + k->off && addr < g_base + k->off + k->len) {
            char msg[320];
            int n = snprintf(msg, sizeof msg,
                             "error: host code touched device memory at %p (offset %zu of a %zu-byte dev_alloc buffer) "
                             "outside the backend (hint: go through dev_upload/dev_download or a kernel; call stack "
                             "below, addr2line -f -e BINARY OFFSET names static functions)\n", (void *)addr,
                             (size_t)(addr - g_base - k->off), k->bytes);
            if (write(2, msg, (size_t)n) < 0) _exit(1);
            void *frames[32];
            backtrace_symbols_fd(frames, backtrace(frames, 32), 2);
            break;
        }
    }
    signal(sig, SIG_DFL); /* the default action: the process dies of SIGSEGV */
    raise(sig);
}

static NOINST void install_handler(void) {
    static int done;
    if (done) return;
    done = 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0) FATAL("device guard: cannot install the SIGSEGV handler");
}

static NOINST Block *new_block(void) {
    if (g_n == g_cap) {
        g_cap = g_cap ? 2 * g_cap : 64;
        g_blocks = realloc(g_blocks, (size_t)g_cap * sizeof(Block));
        if (!g_blocks) FATAL("device guard: out of memory");
    }
    return &g_blocks[g_n++];
}

/* dev_alloc and dev_free run inside the backend: the arena is open. */
NOINST void *guard_alloc(size_t bytes) {
    install_handler();
    if (!g_base) {
        g_base = mmap(NULL, ARENA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (g_base == MAP_FAILED) FATAL("device guard: cannot reserve %zu bytes of address space", ARENA_BYTES);
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE), len = (bytes + page - 1) / page * page;
    if (!len) len = page;
    for (int i = 0; i < g_n; i++) { /* first fit among freed blocks (their pages were zeroed when freed) */
        if (g_blocks[i].used || g_blocks[i].len < len) continue;
        if (g_blocks[i].len > len) { /* split: the rest stays free */
            Block *rest = new_block(); /* may move g_blocks */
            *rest = (Block){g_blocks[i].off + len, g_blocks[i].len - len, 0, 0};
            g_blocks[i].len = len;
        }
        g_blocks[i].used = 1, g_blocks[i].bytes = bytes;
        return g_base + g_blocks[i].off;
    }
    if (g_top + len > ARENA_BYTES) FATAL("dev_alloc: out of guarded memory allocating %zu bytes", bytes);
    *new_block() = (Block){g_top, len, bytes, 1};
    void *p = g_base + g_top;
    g_top += len;
    protect_all(PROT_READ | PROT_WRITE); /* the arena grew while open: open the new pages too */
    return p;
}

NOINST void guard_free(void *p) {
    if (!p) return;
    for (int i = 0; i < g_n; i++) {
        Block *k = &g_blocks[i];
        if (k->used && g_base + k->off == (char *)p) {
            k->used = 0;
            /* back to zero-filled pages, as a fresh dev_alloc must be */
            if (madvise(p, k->len, MADV_DONTNEED) != 0) FATAL("device guard: madvise failed");
            return;
        }
    }
    FATAL("dev_free: %p is not a dev_alloc buffer", p);
}
