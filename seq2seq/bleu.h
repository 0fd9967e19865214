/* Corpus BLEU-4 (Papineni et al. 2002): clipped n-gram precisions for
 * n = 1..4 summed over the corpus, their geometric mean, times the brevity
 * penalty exp(1 - r/c) when the hypotheses are shorter than the references.
 * One reference per sentence, no smoothing (any zero precision gives 0).
 * bleu_add counts token ids; bleu_add_text tokenises a detokenised
 * hypothesis and the raw reference line alike (tokenize_line: lowercase,
 * words and single punctuation characters) and counts those tokens. */
#ifndef KVLAB_BLEU_H
#define KVLAB_BLEU_H

typedef struct {
    long match[4], total[4]; /* clipped matches and hypothesis n-grams, n = 1..4 */
    long hyp_len, ref_len;
} BleuStats;

void bleu_add(BleuStats *s, const int *hyp, int nh, const int *ref, int nr);
void bleu_add_text(BleuStats *s, const char *hyp, const char *ref);
/* 0..100 */
double bleu_score(const BleuStats *s);

#endif
