/* Data of the seq2seq family: the synthetic task sets of one (task, seed)
 * job, and the Multi30k corpus with its vocabularies and length-bucketed
 * batches. */
#ifndef KVLAB_SEQ2SEQ_DATA_H
#define KVLAB_SEQ2SEQ_DATA_H

#include <stdint.h>

#include "common.h"
#include "model.h"
#include "tasks.h"
#include "text.h"

/* ---- synthetic ---------------------------------------------------------- */

typedef struct {
    int T, ntrain, nval, ntest;
    int *train_x, *train_y, *val_x, *val_y, *test_x, *test_y; /* (n, T) */
} SynthData;

void synth_load(SynthData *d, SynthTask task, int T, int ntrain, int nval, int ntest, uint64_t seed);
void synth_free(SynthData *d);

/* ---- translation ------------------------------------------------------------ */

typedef struct {
    const char *src_lang, *tgt_lang;
    Vocab src_vocab, tgt_vocab; /* the same words when shared */
    Corpus train, val, test;    /* ids, no specials; training pairs longer than the limit are dropped */
    Strs val_lines, test_lines; /* the raw target sentences: BLEU references */
    int dropped;                /* training pairs over the length limit */
} TransData;

/* Loads data_dir/multi30k/{train,val,test_2016_flickr}.{de,en}.gz. */
int trans_load(TransData *d, const char *data_dir, int de_en, int min_freq, int max_len, int shared, Err *e);
void trans_free(TransData *d);

/* Batches of the training corpus for one epoch: pairs of similar length
 * batched together, batch order shuffled from (seed, epoch). order gets
 * n indices; starts (nbatches + 1) the batch boundaries. */
int trans_epoch_batches(const TransData *d, int batch, uint64_t seed, int epoch, int *order, int *starts);

/* Pads the pairs idx[0..n) of corpus into src (n, S), tgt_in (n, T) =
 * <bos> y, tgt_out (n, T) = y <eos>; returns S and T through the pointers.
 * Buffers must hold n * (longest + 1). */
void trans_batch(const Corpus *c, const int *idx, int n, int *src, int *tgt_in, int *tgt_out, int *S, int *T);
/* Its two halves: the padded lengths S and T of the pairs idx[0..n), and the padding of pairs to given
 * lengths (at least theirs). Data parallelism pads a rank's share of a batch to the whole batch's lengths,
 * so that every rank computes what one process would. */
void trans_batch_lengths(const Corpus *c, const int *idx, int n, int *S, int *T);
void trans_batch_fill(const Corpus *c, const int *idx, int n, int S, int T, int *src, int *tgt_in, int *tgt_out);

/* Words of ids up to <eos>, without <bos> and <pad> (<unk> stays a word),
 * for BLEU and printing. */
void ids_to_words(const Vocab *v, const int *ids, int n, Strs *out);

/* The model train_seq2seq builds from Kconfig, also what mechint checks a
 * checkpoint against. td: the loaded translation data (vocabulary sizes and
 * the longest sentence set the embeddings and positions); NULL for the
 * synthetic tasks. */
S2SConfig s2s_config_from_kconfig(const TransData *td);

/* The task the binary is built for: translation, or the synthetic tasks. Code
 * names the other task's symbols only in branches on this, which fold away. */
#define TRANSLATION IS_ENABLED(CONFIG_SEQ2SEQ_TASK_TRANSLATION)
#define SYNTH_BOS 10 /* the synthetic decoder's <bos>: the digit after 0..9 */

#endif
