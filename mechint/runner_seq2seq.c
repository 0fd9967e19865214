/* mechint runner for seq2seq checkpoints: the model of seq2seq/model.c on
 * held-out data of its own task: the validation sequences of the synthetic
 * job the checkpoint belongs to (generated from the job's seed as the
 * trainer does), or the Multi30k validation pairs with the vocabularies the
 * trainer builds from the training set. The self-attention layers are the
 * encoder's (bidirectional), then the decoder's (causal), numbered as the
 * model's hooks see them (decoder layer l is L_enc + l). */
#define _POSIX_C_SOURCE 200809L /* strtok_r */
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "buildinfo.h"
#include "kernels.h"
#include "runner.h"
#include "seq2seq/data.h"
#include "seq2seq/model.h"


typedef struct {
    S2S model;
    S2SConfig cfg;
    SynthData sd;     /* synthetic: the job's sets (validation used) */
    int task;
    uint64_t job_seed;
    TransData td;     /* translation */
    int B, nval, nbatches;
    int *idx, *src, *tin, *tout;
    BlockParams *bp;  /* encoder blocks, then the decoder blocks' self-attention parts */
    char *model_json;
} SR;

/* ------------------------------------------------------------------ the synthetic job of a checkpoint */

/* The trainer writes each synthetic job's final model to
 * final_model_step<STEP>-<task>-seed<N>.safetensors and, after the last
 * job, final_model_step<STEP>.safetensors (the last job's model). */
static int job_from_path(const char *ckpt, int *task, uint64_t *seed) {
    const char *base = strrchr(ckpt, '/');
    base = base ? base + 1 : ckpt;
    size_t n = strlen(base);
    const char *ext = ".safetensors";
    if (n > strlen(ext) && !strcmp(base + n - strlen(ext), ext)) n -= strlen(ext);
    /* digits at the end, preceded by "-seed" */
    size_t d = n;
    while (d > 0 && base[d - 1] >= '0' && base[d - 1] <= '9') d--;
    if (d == n || d < 5 || strncmp(base + d - 5, "-seed", 5) != 0) return 0;
    size_t tend = d - 5, tstart = tend;
    while (tstart > 0 && base[tstart - 1] != '-') tstart--;
    if (tstart == 0 || tend - tstart >= 32) return 0;
    char name[32];
    memcpy(name, base + tstart, tend - tstart);
    name[tend - tstart] = '\0';
    int t = task_from_name(name);
    if (t < 0) return 0;
    char digits[32];
    if (n - d >= sizeof digits) return 0;
    memcpy(digits, base + d, n - d);
    digits[n - d] = '\0';
    *task = t;
    *seed = strtoull(digits, NULL, 10);
    return 1;
}

/* The last (task, seed) of CONFIG_SEQ2SEQ_TASKS x CONFIG_SEQ2SEQ_SEEDS, as parse_jobs orders them. */
static int last_job(int *task, uint64_t *seed, Err *e) {
    char *tasks = xstrdup(CONFIG_SEQ2SEQ_TASKS), *seeds = xstrdup(CONFIG_SEQ2SEQ_SEEDS), *save = NULL;
    int found_task = 0, found_seed = 0, rc = 0;
    for (char *t = strtok_r(tasks, ", ", &save); t && rc == 0; t = strtok_r(NULL, ", ", &save)) {
        int k = task_from_name(t);
        if (k < 0)
            rc = err_set(e, "CONFIG_SEQ2SEQ_TASKS: unknown task '%s' (hint: reverse, sort, swap, sub and copy)", t);
        *task = k, found_task = 1;
    }
    save = NULL;
    for (char *s = strtok_r(seeds, ", ", &save); s && rc == 0; s = strtok_r(NULL, ", ", &save)) {
        char *end;
        unsigned long long v = strtoull(s, &end, 10);
        if (*end || end == s) rc = err_set(e, "CONFIG_SEQ2SEQ_SEEDS: '%s' is not a seed (hint: write seeds like 1,2)", s);
        *seed = v, found_seed = 1;
    }
    free(tasks), free(seeds);
    if (rc == 0 && (!found_task || !found_seed)) rc = err_set(e, "CONFIG_SEQ2SEQ_TASKS or CONFIG_SEQ2SEQ_SEEDS is empty");
    return rc;
}

/* ------------------------------------------------------------------ runner */

static double sr_forward(Runner *r, int k, const BlockHook *hook) {
    SR *g = r->impl;
    S2S *m = &g->model;
    if (k < 0 || k >= g->nbatches) FATAL("mechint: seq2seq batch %d of %d", k, g->nbatches);
    int start = k * g->B, b = g->nval - start < g->B ? g->nval - start : g->B;
    double loss;
    int rows;
    m->hook = hook;
    if (TRANSLATION) { /* as trans_eval: pairs in order, padded per batch */
        int S, T;
        trans_batch(&g->td.val, g->idx + start, b, g->src, g->tin, g->tout, &S, &T);
        loss = s2s_forward(m, g->src, S, g->tin, g->tout, T, b, 0, 0);
        rows = b * T;
    } else { /* as synth_eval */
        int T = g->sd.T;
        const int *xs = g->sd.val_x + (size_t)start * T, *ys = g->sd.val_y + (size_t)start * T;
        memcpy(g->tout, ys, (size_t)b * T * sizeof(int));
        if (g->cfg.decoder) { /* teacher-forced: <bos>, y */
            for (int i = 0; i < b; i++)
                for (int t = 0; t < T; t++) g->tin[(size_t)i * T + t] = t == 0 ? SYNTH_BOS : ys[(size_t)i * T + t - 1];
            loss = s2s_forward(m, xs, T, g->tin, g->tout, T, b, 0, 0);
        } else {
            loss = s2s_forward(m, xs, T, NULL, g->tout, T, b, 0, 0);
        }
        rows = b * T;
    }
    m->hook = NULL;
    r->dev_logits = m->acts.logits;
    r->rows = rows;
    r->V = g->cfg.Vt;
    for (int i = 0; i < rows; i++) /* padding (translation) does not count */
        r->targets[i] = g->cfg.pad >= 0 && g->tout[i] == g->cfg.pad ? -1 : g->tout[i];
    return loss;
}

static void sr_backward(Runner *r) {
    SR *g = r->impl;
    params_zero_grad(&g->model.w);
    g->model.external_dlogits = 1;
    s2s_backward(&g->model, 1.0f);
    g->model.external_dlogits = 0;
}

static void sr_free(SR *g) {
    s2s_free(&g->model);
    synth_free(&g->sd);
    if (TRANSLATION) trans_free(&g->td);
    free(g->idx), free(g->src), free(g->tin), free(g->tout), free(g->bp), free(g->model_json);
    free(g);
}

static void sr_close(Runner *r) {
    sr_free(r->impl);
    free(r->targets);
}

int runner_open_seq2seq(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e) {
    SR *g = xcalloc(1, sizeof *g);
    if (TRANSLATION) {
        if (trans_load(&g->td, CONFIG_DATA_DIR, IS_ENABLED(CONFIG_SEQ2SEQ_DE_EN), CONFIG_SEQ2SEQ_MIN_FREQ, CONFIG_SEQ2SEQ_MAX_LEN, IS_ENABLED(CONFIG_SEQ2SEQ_SHARED_EMB), e) != 0) {
            trans_free(&g->td);
            free(g);
            return -1;
        }
        g->nval = g->td.val.n;
    } else {
        if (!job_from_path(ckpt, &g->task, &g->job_seed) && last_job(&g->task, &g->job_seed, e) != 0) {
            free(g);
            return -1;
        }
        synth_load(&g->sd, (SynthTask)g->task, CONFIG_SEQ2SEQ_SEQ_LEN, CONFIG_SEQ2SEQ_TRAIN_SEQS, CONFIG_SEQ2SEQ_VAL_SEQS, CONFIG_SEQ2SEQ_TEST_SEQS, g->job_seed);
        g->nval = g->sd.nval;
    }
    S2SConfig c = s2s_config_from_kconfig(TRANSLATION ? &g->td : NULL); /* as train_seq2seq builds it */
    S2SConfig as_trained = c;
    c.dropout = 0.0f; /* eval mode everywhere (the checkpoint's model text still says what it trained with) */
    g->cfg = c;
    s2s_init(&g->model, &c, seed);
    g->model_json = s2s_config_json(&as_trained);
    if (checkpoint_load_model(ckpt, "seq2seq", attn_variant_id(ATTN_VARIANT, ATTN_POS), MECHINT_VARIANT_HINT,
                              g->model_json, "the checkpoint has another model shape or vocabulary",
                              NULL, NULL, /* built from the checkpoint's own configuration: its data by construction */
                              &g->model.w, e) != 0) {
        sr_free(g);
        return -1;
    }
    if (batch_size < 1) batch_size = 1;
    g->B = batch_size;
    int all_batches = (g->nval + g->B - 1) / g->B;
    g->nbatches = max_batches > 0 && max_batches < all_batches ? max_batches : all_batches;
    size_t buf = (size_t)g->B * (c.Tmax + 2);
    g->src = xmalloc(buf * sizeof(int)), g->tin = xmalloc(buf * sizeof(int)), g->tout = xmalloc(buf * sizeof(int));
    g->idx = xmalloc((size_t)(g->nval ? g->nval : 1) * sizeof(int));
    for (int i = 0; i < g->nval; i++) g->idx[i] = i;
    r->impl = g;
    r->family = "seq2seq";
    r->unit = c.decoder ? "target tokens" : "tokens";
    r->targets = xmalloc(buf * sizeof(int));
    r->nbatches = g->nbatches;
    int used = g->nbatches * g->B < g->nval ? g->nbatches * g->B : g->nval;
    if (TRANSLATION) {
        long tokens = 0;
        for (int i = 0; i < used; i++) tokens += g->td.val.tgt_len[i] + 1;
        snprintf(r->data_desc, sizeof r->data_desc,
                 "multi30k %s->%s validation pairs: %d batches of up to %d pairs (%d of %d pairs, %ld target tokens)",
                 g->td.src_lang, g->td.tgt_lang, r->nbatches, g->B, used, g->nval, tokens);
    } else {
        snprintf(r->data_desc, sizeof r->data_desc,
                 "synthetic %s task (job seed %llu) validation sequences: %d batches of up to %d sequences of %d "
                 "digits (%d of %d sequences, %ld %s)",
                 task_name((SynthTask)g->task), (unsigned long long)g->job_seed, r->nbatches, g->B, g->sd.T, used,
                 g->nval, (long)used * g->sd.T, r->unit);
    }
    /* the fixed sinusoids added to the encoder input */
    runner_setup(r, &g->model.w, g->model.pe, c.Tmax, c.C, block_position_kind("sinusoidal"));
    int L = c.L_enc + (c.decoder ? c.L_dec : 0);
    g->bp = xmalloc((size_t)L * sizeof(BlockParams));
    for (int l = 0; l < L; l++) {
        int dec = l >= c.L_enc;
        g->bp[l] = dec ? g->model.dec[l - c.L_enc].b : g->model.enc[l];
        runner_layer(r, l, dec ? "dec" : "enc", dec ? l - c.L_enc : l, dec);
    }
    /* every linear layer and LayerNorm has a bias, the projections too (seq2seq/model.c shape()) */
    r->src = (ModelSource){.params = r->host_params, .bp = g->bp, .L = L, .H = c.H, .C = c.C, .variant = c.variant,
                           .pos = c.pos, .pos_m = c.pos_m, .pos_groups = c.pos_groups, .kv_heads = c.kv_heads, .bias = 1, .attn_bias = 1,
                           .post_ln = c.post_ln, .causal = r->layer_causal, .names = r->layer_names};
    r->pos_feat = g->model.pos_feat, r->pos_T = c.Tmax, r->max_T = c.Tmax;
    r->forward = sr_forward;
    r->backward = sr_backward;
    r->forward_tokens = NULL;
    r->vocab = 0, r->ctx = 0;
    r->close = sr_close;
    return 0;
}
