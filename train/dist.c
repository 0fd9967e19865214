/* What every transport shares (train/dist.h): the thread share of a rank,
 * and the single-process transport's few out-of-line functions. */
#define _GNU_SOURCE
#include "dist.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"

int dist_threads(int configured) {
    if (configured > 0 || dist_size() == 1) return configured;
    const char *env = getenv("OMP_NUM_THREADS");
    char *end;
    long n = env ? strtol(env, &end, 10) : 0;
    if (env && *env && !*end && n > 0 && n <= 1024) return (int)n;
    cpu_set_t set;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)online;
    if (mine < online) return mine > 0 ? mine : 1; /* the launcher bound this rank to its share */
    int share = (int)(online / dist_local_size());
    return share > 0 ? share : 1;
}

#if IS_ENABLED(CONFIG_DIST_NONE)
const char *dist_host(void) {
    static char host[256];
    if (!host[0] && gethostname(host, sizeof host - 1) != 0) strcpy(host, "localhost");
    return host;
}

void dist_gather_dev(float *host_full, const float *slice, size_t n) {
    dev_download(host_full, slice, n * sizeof(float));
}

void dist_scatter_dev(float *slice, const float *host_full, size_t n) {
    dev_upload(slice, host_full, n * sizeof(float));
}
#endif
