/* wandb_sync: uploads W&B runs spooled by offline runs, or by online runs
 * whose upload stopped (make wandb-sync). Each DIR is a spool folder
 * (.../wandb-c/<run_id>/) or any folder above spool folders (a run's output
 * folder: <output>/<run>/wandb/<step>/wandb-c/<run_id>/). Prints one line per
 * run: its URL or the error; exits 1 if any run failed. Key, timeouts etc. come from the environment
 * (WANDB_API_KEY or ~/.netrc, WANDB_BASE_URL, ...), see docs/wandb.md. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

static int has_spool(const char *dir) {
    char *path = wb_join(dir, "spool.jsonl");
    int yes = file_exists(path);
    free(path);
    return yes;
}

static int sync_one(const char *dir, const WandbSettings *s) {
    Err e;
    if (wandb_sync_dir(dir, s, &e) == 0) return 0;
    fprintf(stderr, "wandb: %s\n", e.msg);
    return 1;
}

/* Syncs every spool folder at or below dir (sorted, so reruns go in the same
 * order; run files/ folders are not searched); adds to *found and returns the failures. */
static int sync_tree(const char *dir, const WandbSettings *s, int depth, int *found) {
    if (has_spool(dir)) {
        ++*found;
        return sync_one(dir, s);
    }
    struct dirent **names;
    int n = depth < 8 ? scandir(dir, &names, NULL, alphasort) : -1, failed = 0;
    for (int i = 0; i < n; i++) {
        if (names[i]->d_name[0] != '.' && (names[i]->d_type == DT_DIR || names[i]->d_type == DT_UNKNOWN)) {
            char *sub = wb_join(dir, names[i]->d_name);
            failed += sync_tree(sub, s, depth + 1, found);
            free(sub);
        }
        free(names[i]);
    }
    if (n >= 0) free(names);
    return failed;
}

int main(int argc, char **argv) {
    WandbSettings s = {0};
    int first = 1;
    if (argc > 2 && !strcmp(argv[1], "--base-url")) {
        s.base_url = argv[2][0] ? argv[2] : NULL; /* empty: $WANDB_BASE_URL, else the cloud */
        first = 3;
    }
    if (first >= argc || argv[first][0] == '-') {
        fprintf(stderr, "usage: wandb_sync [--base-url URL] DIR...\n"
                        "  DIR: a spool folder (.../wandb-c/<run_id>) or a folder above spool folders (output/<run>)\n");
        return 2;
    }
    int failed = 0;
    for (int i = first; i < argc; i++) {
        int found = 0;
        struct stat st;
        if (stat(argv[i], &st) != 0 || !S_ISDIR(st.st_mode)) {
            fprintf(stderr, "wandb: %s: %s (hint: DIR is a run's output folder, output/<run>, or a spool folder in "
                            "it)\n", argv[i], stat(argv[i], &st) != 0 ? strerror(errno) : "not a folder");
            failed++;
            continue;
        }
        failed += sync_tree(argv[i], &s, 0, &found);
        if (!found) {
            fprintf(stderr, "wandb: %s: no spooled runs found (hint: runs write them to <output>/<run>/wandb/<step>/ "
                            "when CONFIG_WANDB is on)\n", argv[i]);
            failed++;
        }
    }
    return failed ? 1 : 0;
}
