#include "bleu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "text.h"

/* Occurrences of the n-gram at a[i..i+n) in b (length nb). */
static int count_in(const int *a, int i, int n, const int *b, int nb) {
    int c = 0;
    for (int j = 0; j + n <= nb; j++) {
        int k = 0;
        while (k < n && a[i + k] == b[j + k]) k++;
        c += k == n;
    }
    return c;
}

/* Has the n-gram at a[i..) appeared earlier in a (so it was counted already)? */
static int seen_before(const int *a, int i, int n) {
    for (int j = 0; j < i; j++) {
        int k = 0;
        while (k < n && a[i + k] == a[j + k]) k++;
        if (k == n) return 1;
    }
    return 0;
}

void bleu_add(BleuStats *s, const int *hyp, int nh, const int *ref, int nr) {
    s->hyp_len += nh;
    s->ref_len += nr;
    for (int n = 1; n <= 4; n++) {
        if (nh >= n) s->total[n - 1] += nh - n + 1;
        /* clipped matches: each distinct hypothesis n-gram counts min(hyp count, ref count) */
        for (int i = 0; i + n <= nh; i++) {
            if (seen_before(hyp, i, n)) continue;
            int h = count_in(hyp, i, n, hyp, nh), r = count_in(hyp, i, n, ref, nr);
            s->match[n - 1] += h < r ? h : r;
        }
    }
}

double bleu_score(const BleuStats *s) {
    double log_p = 0.0;
    for (int n = 0; n < 4; n++) {
        if (s->total[n] == 0 || s->match[n] == 0) return 0.0;
        log_p += log((double)s->match[n] / (double)s->total[n]) / 4.0;
    }
    double bp = s->hyp_len < s->ref_len ? exp(1.0 - (double)s->ref_len / (double)s->hyp_len) : 1.0;
    return 100.0 * bp * exp(log_p);
}

/* Local ids of a word among the words seen so far in this pair (sentences are short). */
static int local_id(Strs *seen, const char *w) {
    for (int i = 0; i < seen->n; i++)
        if (!strcmp(seen->s[i], w)) return i;
    strs_push(seen, w, strlen(w));
    return seen->n - 1;
}

void bleu_add_text(BleuStats *s, const char *hyp, const char *ref) {
    Strs h = {0}, r = {0}, seen = {0};
    tokenize_line(hyp, &h);
    tokenize_line(ref, &r);
    int *hi = xmalloc((size_t)(h.n + 1) * sizeof(int)), *ri = xmalloc((size_t)(r.n + 1) * sizeof(int));
    for (int i = 0; i < h.n; i++) hi[i] = local_id(&seen, h.s[i]);
    for (int i = 0; i < r.n; i++) ri[i] = local_id(&seen, r.s[i]);
    bleu_add(s, hi, h.n, ri, r.n);
    free(hi), free(ri);
    strs_free(&h), strs_free(&r), strs_free(&seen);
}
