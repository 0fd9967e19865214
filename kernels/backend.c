/* The backend-neutral part of every backend (kernels/backend.h): argument
 * checks and dropout bookkeeping. */
#include "backend.h"

#include "common.h"
#include "hash.h"
#include "kernels.h"

/* ------------------------------------------------------------------ dropout */

uint64_t dropout_seed(uint64_t run_seed, uint64_t step, uint64_t site) {
    return mix64(mix64(run_seed * 0x9e3779b97f4a7c15ull + step) ^ (site * 0xd1b54a32d192ed03ull));
}

uint32_t dropout_threshold(float p, const char *op) {
    if (!(p >= 0.0f && p < 1.0f)) FATAL("%s: dropout probability must be in [0, 1), got %g", op, (double)p);
    return (uint32_t)(p * 16777216.0f);
}

static int g_batch_first, g_batch_count; /* dropout_batch_rows */

void dropout_batch_rows(int first, int count) {
    if (first < 0 || count < 0 || (first > 0 && count == 0))
        FATAL("dropout_batch_rows: rows [%d, %d + %d) of a global batch", first, first, count);
    g_batch_first = first;
    g_batch_count = count;
}

int dropout_batch_first(void) { return g_batch_first; }

size_t dropout_batch_offset(size_t n, const char *op) {
    if (!g_batch_count) return 0;
    if (n % (size_t)g_batch_count)
        FATAL("%s: %zu values are not %d batch rows (dropout_batch_rows)", op, n, g_batch_count);
    return (size_t)g_batch_first * (n / (size_t)g_batch_count);
}

/* ------------------------------------------------------------------ attention */

void attn_check_args(const char *op, int B, int Tq, int Tk, int H, int hd, float dropout) {
    if (B <= 0 || Tq <= 0 || Tk <= 0 || H <= 0 || hd <= 0)
        FATAL("%s: bad shape B=%d Tq=%d Tk=%d H=%d head_dim=%d (all must be positive)", op, B, Tq, Tk, H, hd);
    if (!(dropout >= 0.0f && dropout < 1.0f)) FATAL("%s: dropout must be in [0, 1), got %g", op, (double)dropout);
}

int attn_check_kv_heads(const char *op, int H, int kv_heads) {
    int G = attn_kv_count(H, kv_heads);
    if (G < 1 || G > H || H % G != 0)
        FATAL("%s: %d K/V heads for %d query heads (the K/V head count must divide the query head count)", op, G, H);
    if (G != H && attn_symmetric(ATTN_VARIANT))
        FATAL("%s: %d K/V heads for %d query heads in variant %s, whose key also plays the query role (grouped K/V "
              "heads are defined for QKV and KV tying only)", op, G, H, attn_variant_label(ATTN_VARIANT, 0));
    return G;
}

int attn_check_pos(const char *op, const AttnPos *pos, int H, int hd, int T) {
    if (ATTN_POS) {
        if (!pos || !pos->w || !pos->b || !pos->feat) FATAL("%s: +Pos is configured but no positional weights given", op);
        if (pos->m != ATTN_POS_DIM) FATAL("%s: positional dim %d, configured %d", op, pos->m, ATTN_POS_DIM);
        if (pos->groups != (ATTN_POS_PER_HEAD ? H : 1))
            FATAL("%s: %d +Pos weight groups, configured %d", op, pos->groups, ATTN_POS_PER_HEAD ? H : 1);
        if (pos->T < T) FATAL("%s: +Pos basis has %d positions, sequence has %d", op, pos->T, T);
    } else if (pos && (pos->w || pos->b)) {
        FATAL("%s: +Pos weights given but +Pos is not configured", op);
    }
    int scheme = pos ? pos->scheme : ATTN_POSITION_ABSOLUTE;
    if (scheme < 0 || scheme >= ATTN_NUM_POSITIONS) FATAL("%s: position scheme %d is not in the table", op, scheme);
    if (attn_positions[scheme].where == ATTN_PE_ROTARY) {
        if (!pos->rope || pos->rope_hd != hd || pos->T < T)
            FATAL("%s: RoPE table for head dim %d and %d positions, the call has head dim %d and %d positions", op,
                  pos->rope ? pos->rope_hd : 0, pos->rope ? pos->T : 0, hd, T);
    }
    if (scheme == ATTN_POSITION_REL_BIAS && (!pos->rel || pos->rel_buckets < 4 || pos->rel_max_distance < 2))
        FATAL("%s: relative bias without its weights or with %d buckets / max distance %d (at least 4 / 2)", op,
              pos->rel_buckets, pos->rel_max_distance);
    return scheme;
}
