/* Multi30k as the translation trainer loads it (seq2seq/data.c trans_load): the direction
 * (CONFIG_SEQ2SEQ_DE_EN or EN_DE) swaps the languages and their vocabularies, and
 * CONFIG_SEQ2SEQ_SHARED_EMB builds one vocabulary over both sides' training text. The same in every
 * attention configuration, so a program of its own, built once. KVLAB_DATA_DIR (default "data") holds
 * multi30k/; without it the cases say SKIP. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "seq2seq/data.h"
#include "seq2seq/text.h"
#include "test.h"

static int same_words(const Vocab *a, const Vocab *b) {
    if (a->words.n != b->words.n) return 0;
    for (int i = 0; i < a->words.n; i++)
        if (strcmp(a->words.s[i], b->words.s[i])) return 0;
    return 1;
}

static void test_multi30k_vocabularies(void) {
    const char *dir = getenv("KVLAB_DATA_DIR") ? getenv("KVLAB_DATA_DIR") : "data";
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/multi30k/train.de.gz", dir);
    if (access(probe, R_OK) != 0) {
        printf("SKIP Multi30k vocabularies: %s is absent (scripts/get_data.sh multi30k)\n", probe);
        return;
    }
    TransData de, en, sh;
    Err e;
    int min_freq = 2;
    CHECK(trans_load(&de, dir, 1, min_freq, 0, 0, &e) == 0, "Multi30k de->en: %s", e.msg);
    CHECK(trans_load(&en, dir, 0, min_freq, 0, 0, &e) == 0, "Multi30k en->de: %s", e.msg);
    CHECK(trans_load(&sh, dir, 1, min_freq, 0, 1, &e) == 0, "Multi30k de->en, shared vocabulary: %s", e.msg);
    CHECK(!strcmp(de.src_lang, "de") && !strcmp(de.tgt_lang, "en") && !strcmp(en.src_lang, "en") &&
              !strcmp(en.tgt_lang, "de"),
          "the direction names the languages: %s->%s, %s->%s", de.src_lang, de.tgt_lang, en.src_lang, en.tgt_lang);
    CHECK(same_words(&de.src_vocab, &en.tgt_vocab) && same_words(&de.tgt_vocab, &en.src_vocab) &&
              !same_words(&de.src_vocab, &de.tgt_vocab),
          "EN_DE swaps the two vocabularies (German %d words, English %d)", de.src_vocab.words.n,
          de.tgt_vocab.words.n);
    CHECK(de.train.n == en.train.n && de.val.n == 1014 && de.test.n == 1000 && en.test.n == 1000,
          "both directions keep every pair: %d training pairs, 1014 validation, 1000 test", de.train.n);
    int n = sh.src_vocab.words.n;
    CHECK(same_words(&sh.src_vocab, &sh.tgt_vocab) && n > de.src_vocab.words.n && n > de.tgt_vocab.words.n &&
              n < de.src_vocab.words.n + de.tgt_vocab.words.n,
          "SHARED_EMB: one vocabulary for both sides, more words than either and fewer than both (%d; %d + %d)", n,
          de.src_vocab.words.n, de.tgt_vocab.words.n);
    CHECK(vocab_id(&sh.src_vocab, "mann") != TOK_UNK && vocab_id(&sh.src_vocab, "man") != TOK_UNK &&
              vocab_id(&sh.tgt_vocab, "mann") == vocab_id(&sh.src_vocab, "mann") &&
              vocab_id(&de.tgt_vocab, "mann") == TOK_UNK,
          "SHARED_EMB: German and English words in the one table (\"mann\" is not in the English one)");
    trans_free(&de), trans_free(&en), trans_free(&sh);
}

int main(void) {
    test_multi30k_vocabularies();
    return TEST_SUMMARY("test_seq2seq_data");
}
