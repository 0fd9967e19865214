/* tokenize: encodes a UTF-8 text file with GPT-2 BPE into llm.c token
 * shards (formats.md §2.3). The input is one document, so the token stream
 * is <|endoftext|> followed by the text's tokens; the first N tokens go to
 * PREFIX_val_000000.bin and the rest to PREFIX_train_000001.bin, like
 * llm.c's tiny Shakespeare split. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <unistr.h>

#include "bpe.h"
#include "common.h"
#include "token_shards.h"

static void usage(FILE *f) {
    fprintf(f, "usage: tokenize --encoder PATH --vocab PATH --input TEXT --out-prefix PREFIX [--val-tokens N]\n"
               "  --encoder PATH     GPT-2 encoder.json\n"
               "  --vocab PATH       GPT-2 vocab.bpe\n"
               "  --input TEXT       UTF-8 text file, encoded as one document\n"
               "  --out-prefix P     writes P_val_000000.bin and P_train_000001.bin\n"
               "  --val-tokens N     tokens in the validation shard (default 32768)\n");
}

static int fail(const char *msg) {
    fprintf(stderr, "tokenize: error: %s\n", msg);
    return 1;
}

int main(int argc, char **argv) {
    const char *encoder = NULL, *vocab = NULL, *input = NULL, *prefix = NULL;
    long long val_tokens = 32768;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tokenize: error: %s needs a value (hint: see tokenize --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--encoder") == 0) {
            encoder = v;
        } else if (strcmp(a, "--vocab") == 0) {
            vocab = v;
        } else if (strcmp(a, "--input") == 0) {
            input = v;
        } else if (strcmp(a, "--out-prefix") == 0) {
            prefix = v;
        } else if (strcmp(a, "--val-tokens") == 0) {
            char *end;
            errno = 0;
            val_tokens = strtoll(v, &end, 10);
            if (errno || end == v || *end || val_tokens < 1) {
                fprintf(stderr, "tokenize: error: --val-tokens '%s' is not a positive integer (hint: the tokens of "
                                "the validation shard, e.g. 32768)\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "tokenize: error: unknown option '%s' (hint: see tokenize --help)\n", a);
            return 2;
        }
    }
    if (!encoder || !vocab || !input || !prefix || !*prefix) {
        fprintf(stderr, "tokenize: error: --encoder, --vocab, --input and --out-prefix are required (hint: the usage "
                        "below; make runs it through scripts/get_data.sh tinyshakespeare-bpe)\n");
        usage(stderr);
        return 2;
    }

    Err e;
    Bpe *bpe = bpe_load(encoder, vocab, &e);
    if (!bpe) return fail(e.msg);
    size_t len;
    char *text = read_file(input, &len, &e);
    if (!text) {
        bpe_free(bpe);
        fprintf(stderr, "tokenize: error: %s (hint: check --input)\n", e.msg);
        return 1;
    }
    const uint8_t *bad = u8_check((const uint8_t *)text, len);
    if (bad) /* still lossless: each invalid byte becomes its own token */
        fprintf(stderr, "tokenize: warning: %s: not valid UTF-8 at byte %zu; invalid bytes are encoded one by one\n",
                input, (size_t)(bad - (const uint8_t *)text));
    double t0 = wall_seconds();
    size_t n = 0, cap = 1;
    int *ids = xmalloc(cap * sizeof(int));
    ids[n++] = bpe_eot(bpe); /* the document starts with <|endoftext|>, as in llm.c's data scripts */
    int rc = bpe_encode(bpe, text, len, &ids, &n, &cap, &e);
    double dt = wall_seconds() - t0;
    free(text);
    bpe_free(bpe);
    if (rc != 0) {
        free(ids);
        return fail(e.msg);
    }
    printf("%s: %zu bytes -> %zu tokens (incl. the leading <|endoftext|>) in %.3f s\n", input, len, n, dt);
    if ((size_t)val_tokens >= n) {
        fprintf(stderr, "tokenize: error: %s: only %zu tokens, need more than --val-tokens %lld to leave a training shard (hint: lower --val-tokens)\n",
                input, n, val_tokens);
        free(ids);
        return 1;
    }

    /* create the prefix's folder, e.g. data/tinyshakespeare/ */
    char *dir = xstrdup(prefix);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        if (make_dirs(dir, &e) != 0) {
            free(dir);
            free(ids);
            return fail(e.msg);
        }
    }
    free(dir);
    size_t plen = strlen(prefix) + 32;
    char *val_path = xmalloc(plen), *train_path = xmalloc(plen);
    snprintf(val_path, plen, "%s_val_000000.bin", prefix);
    snprintf(train_path, plen, "%s_train_000001.bin", prefix);
    size_t nval = (size_t)val_tokens;
    /* both written before either is moved into place: a failure (a full disk on the large training shard) leaves
     * an earlier pair as it was, never a new validation shard beside an old training one. The earlier training
     * shard keeps a second name (a hard link) until the new validation shard is in place too: should that last
     * rename fail, it is put back (or, with none before, the new one removed), so the pair is never mixed. */
    AtomicFile val_f, train_f;
    char *earlier = xmalloc(plen + 48);
    int kept = 0, none_before = 0;
    for (int k = 0; k < 100; k++) { /* a name no other tokenize holds (one left behind may be a shard's last name) */
        snprintf(earlier, plen + 48, "%s.earlier.%ld.%d", train_path, (long)getpid(), k);
        kept = link(train_path, earlier) == 0;
        none_before = !kept && errno == ENOENT;
        if (kept || errno != EEXIST) break;
    }
    int keep_earlier = 0; /* the rename back failed: the earlier shard's last name */
    rc = 1;
    if (shard_stage(&train_f, train_path, ids + nval, n - nval, &e) == 0) {
        /* both on disk (a full disk may show only at fsync) before the first rename */
        if (shard_stage(&val_f, val_path, ids, nval, &e) != 0 || atomic_sync(&val_f, &e) != 0)
            atomic_abort(&train_f);
        else if (atomic_sync(&train_f, &e) != 0 || atomic_commit(&train_f, &e) != 0)
            atomic_abort(&val_f);
        else if (atomic_commit(&val_f, &e) != 0) {
            char hint[4400];
            if (kept && rename(earlier, train_path) == 0)
                snprintf(hint, sizeof hint, "the earlier pair of shards is kept as it was; free %s and tokenize again",
                         val_path);
            else if (none_before && unlink(train_path) == 0)
                snprintf(hint, sizeof hint, "the new training shard is removed again; free %s and tokenize again",
                         val_path);
            else {
                keep_earlier = kept;
                snprintf(hint, sizeof hint, "the training shard is new and the validation shard is not: tokenize "
                         "again%s%s", kept ? "; the earlier training shard is in " : "", kept ? earlier : "");
            }
            err_with_hint(&e, &e, hint);
        } else {
            rc = 0;
        }
    }
    if (kept && !keep_earlier) unlink(earlier); /* gone already where it was put back */
    free(earlier);
    if (rc == 0) {
        printf("wrote %s (%zu tokens)\n", val_path, nval);
        printf("wrote %s (%zu tokens)\n", train_path, n - nval);
    } else {
        fprintf(stderr, "tokenize: error: %s\n", e.msg);
    }
    free(val_path);
    free(train_path);
    free(ids);
    return rc;
}
