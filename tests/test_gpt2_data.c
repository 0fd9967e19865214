/* GPT-2 data sets: the numbers corpus against the reference's facts, the
 * tiny Shakespeare split, window batching, and clear errors on bad files.
 * KVLAB_DATA_DIR (default "data") holds the real files; cases that need them
 * say SKIP when they are absent. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "gpt2/data.h"
#include "test.h"

static const char *data_dir(void) {
    const char *d = getenv("KVLAB_DATA_DIR");
    return d ? d : "data";
}

static void test_number_words(void) {
    char buf[128];
    struct {
        int n;
        const char *want;
    } cases[] = {{1, "one"},
                 {15, "fifteen"},
                 {40, "forty"},
                 {99, "ninety nine"},
                 {110, "one hundred ten"},
                 {1000, "one thousand"},
                 {8001, "eight thousand one"},
                 {9999, "nine thousand nine hundred ninety nine"},
                 {2020, "two thousand twenty"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        number_words(cases[i].n, buf, sizeof buf);
        CHECK(strcmp(buf, cases[i].want) == 0, "number_words(%d) = '%s', expected '%s'", cases[i].n, buf,
              cases[i].want);
    }
}

static void test_numbers_corpus(void) {
    /* attention-variants.md 7.5: 63,095 tokens, 30 types, ids by first appearance
     * ('.' = 1), 3943 / 1971 / 985 / 492 windows for sl = 16 / 32 / 64 / 128 */
    static const int sl[4] = {16, 32, 64, 128}, windows[4] = {3943, 1971, 985, 492};
    for (int k = 0; k < 4; k++) {
        Dataset d;
        Err e;
        CHECK(dataset_load_kind(&d, DATA_NUMBERS, data_dir(), sl[k], &e) == 0, "numbers load: %s", e.msg);
        size_t nwin = d.train_windows + d.val_windows;
        CHECK(nwin == (size_t)windows[k], "sl=%d: %zu windows, expected %d", sl[k], nwin, windows[k]);
        CHECK(d.train_windows == (size_t)windows[k] * 8 / 10, "sl=%d: first 80%% of windows train", sl[k]);
        if (k == 0) {
            CHECK(d.ntrain == 63095, "numbers corpus has %zu tokens, expected 63,095", d.ntrain);
            CHECK(d.V == 30, "numbers vocabulary has %d types, expected 30", d.V);
            CHECK(!strcmp(d.words[0], "one") && !strcmp(d.words[1], ".") && !strcmp(d.words[2], "two") &&
                      !strcmp(d.words[29], "thousand"),
                  "ids by first appearance: one . two ... thousand");
            /* validation = the highest numbers, evaluated in order and completely */
            int B = 64, nb = dataset_val_batches(&d, B, 1000);
            CHECK(nb == (int)((d.val_windows + B - 1) / B), "all %zu validation windows in %d batches",
                  d.val_windows, nb);
            int *x = xmalloc((size_t)B * 16 * sizeof(int)), *y = xmalloc((size_t)B * 16 * sizeof(int));
            long counted = 0;
            int shifted = 1;
            for (int b = 0; b < nb; b++) {
                dataset_val_batch(&d, b, B, 1000, x, y, &e);
                for (int i = 0; i < B * 16; i++) {
                    counted += y[i] >= 0;
                    if (y[i] >= 0 && i % 16 < 15) shifted &= y[i] == x[i + 1];
                }
            }
            CHECK(counted == (long)d.val_windows * 16, "every validation target counts once (%ld)", counted);
            CHECK(shifted, "targets are the inputs shifted by one");
            Rng rng = rng_seeded(1, 2);
            dataset_train_batch(&d, &rng, B, x, y, &e);
            int pairs = 1;
            for (int b = 0; b < B; b++) pairs &= y[b * 16] == x[b * 16 + 1] && y[b * 16 + 14] == x[b * 16 + 15];
            CHECK(pairs, "training windows are shifted pairs");
            free(x);
            free(y);
        }
        dataset_free(&d);
    }
}

static void test_prompts(void) {
    Dataset d;
    Err e;
    dataset_load_kind(&d, DATA_NUMBERS, data_dir(), 16, &e);
    int *ids;
    size_t n;
    CHECK(dataset_encode(&d, "one hundred", &ids, &n, &e) == 0 && n == 2, "numbers prompt encodes to words");
    free(ids);
    CHECK(dataset_encode(&d, "one zillion", &ids, &n, &e) != 0 && strstr(e.msg, "zillion"),
          "an unknown word is named: %s", e.msg);
    dataset_free(&d);
}

static void write_bytes(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) FATAL("cannot write %s", path);
    fwrite(data, 1, n, f);
    fclose(f);
}

/* A file counts as verified when its size and CRC-32 are those scripts/get_data.sh recorded beside it
 * (path's folder exists; the record is removed again). */
static void test_verified_record(const char *path) {
    char stamp[600];
    snprintf(stamp, sizeof stamp, "%s.verified", path);
    char data[] = "123456789"; /* CRC-32 check value cbf43926 */
    Err e;
    CHECK(data_file_verified(path, data, 9, "set", &e) != 0 && strstr(e.msg, path) && strstr(e.msg, "not verified") &&
              strstr(e.msg, "get_data.sh set"),
          "a file without a record is refused, naming it and the data script: %s", e.msg);
    write_bytes(stamp, "size 9 crc32 cbf43926 md5 25f9e794323b453885f5181f1b624d0b\n", 59);
    CHECK(data_file_verified(path, data, 9, "set", &e) == 0, "the verified bytes pass: %s", e.msg);
    data[4] = 'x';
    CHECK(data_file_verified(path, data, 9, "set", &e) != 0 && strstr(e.msg, path) &&
              strstr(e.msg, "not the file the data script verified") && strstr(e.msg, "hint"),
          "the same size with other bytes is refused: %s", e.msg);
    CHECK(data_file_verified(path, data, 8, "set", &e) != 0, "another size is refused: %s", e.msg);
    write_bytes(stamp, "checked\n", 8);
    CHECK(data_file_verified(path, "123456789", 9, "set", &e) != 0 && strstr(e.msg, "no valid"),
          "a malformed record is refused: %s", e.msg);
    unlink(stamp);
}

static void test_shakespeare(void) {
    /* a wrong or missing file gets an error naming it */
    char dir[] = "/tmp/kvlab_test_data_XXXXXX";
    if (!mkdtemp(dir)) FATAL("mkdtemp failed");
    char sub[256], path[512];
    snprintf(sub, sizeof sub, "%s/tinyshakespeare", dir);
    snprintf(path, sizeof path, "%s/input.txt", sub);
    Dataset d;
    Err e;
    CHECK(dataset_load_kind(&d, DATA_CHAR, dir, 64, &e) != 0 && strstr(e.msg, path) && strstr(e.msg, "get_data.sh"),
          "a missing text file is named with a hint: %s", e.msg);
    mkdir(sub, 0755);
    write_bytes(path, "First Citizen:\nBefore we proceed any further, hear me speak.\n", 62);
    CHECK(dataset_load_kind(&d, DATA_CHAR, dir, 64, &e) != 0 && strstr(e.msg, path) && strstr(e.msg, "1115394"),
          "a cut-short text file is rejected: %s", e.msg);
    test_verified_record(path);
    unlink(path);
    rmdir(sub);
    rmdir(dir);

    /* the real file: 65 characters, 90/10 split of 1,115,394 bytes */
    snprintf(path, sizeof path, "%s/tinyshakespeare/input.txt", data_dir());
    if (!file_exists(path)) {
        printf("SKIP tiny Shakespeare facts: %s is absent (scripts/get_data.sh tinyshakespeare fetches it)\n", path);
        return;
    }
    CHECK(dataset_load_kind(&d, DATA_CHAR, data_dir(), 64, &e) == 0, "load: %s", e.msg);
    CHECK(d.V == 65, "tiny Shakespeare has %d distinct characters, expected 65", d.V);
    CHECK(d.ntrain == 1003854 && d.nval == 111540, "90/10 split: %zu / %zu", d.ntrain, d.nval);
    int sorted = 1;
    for (int i = 1; i < d.V; i++) sorted &= (unsigned char)d.chars[i - 1] < (unsigned char)d.chars[i];
    CHECK(sorted && d.chars[0] == '\n', "the vocabulary is the sorted distinct bytes");
    int B = 4, T = 64, *x = xmalloc((size_t)B * T * sizeof(int)), *y = xmalloc((size_t)B * T * sizeof(int));
    int *x2 = xmalloc((size_t)B * T * sizeof(int)), *y2 = xmalloc((size_t)B * T * sizeof(int));
    dataset_val_batch(&d, 1, B, 5, x, y, &e);
    dataset_val_batch(&d, 1, B, 5, x2, y2, &e);
    CHECK(!memcmp(x, x2, (size_t)B * T * sizeof(int)), "validation windows are the same at every evaluation");
    Rng r1 = rng_seeded(9, 2), r2 = rng_seeded(9, 2);
    dataset_train_batch(&d, &r1, B, x, y, &e);
    dataset_train_batch(&d, &r2, B, x2, y2, &e);
    CHECK(!memcmp(x, x2, (size_t)B * T * sizeof(int)) && r1.state == r2.state,
          "training batches are a function of the seed and the stream position");
    int *ids;
    size_t n;
    CHECK(dataset_encode(&d, "ROMEO:", &ids, &n, &e) == 0 && n == 6, "character prompt");
    free(ids);
    CHECK(dataset_encode(&d, "caf\xc3\xa9", &ids, &n, &e) != 0 && strstr(e.msg, "0xc3"),
          "a character outside the vocabulary is named: %s", e.msg);
    free(x), free(y), free(x2), free(y2);
    dataset_free(&d);
}

int main(void) {
    test_number_words();
    test_numbers_corpus();
    test_prompts();
    test_shakespeare();
    return TEST_SUMMARY("test_gpt2_data");
}
