/* Opening a checkpoint for analysis: its family picks the runner. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "runner.h"
#include "safetensors.h"

int runner_open(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e) {
    memset(r, 0, sizeof *r);
    StFile *f = st_open(ckpt, e);
    if (!f) return -1;
    const char *fw = st_meta(f, "framework"), *fam = st_meta(f, "family");
    int rc;
    if (!fw || strcmp(fw, "kvlab") != 0 || !fam) {
        rc = err_set(e, "%s: not a kvlab checkpoint (safetensors without kvlab metadata) (hint: pass files written by "
                        "a kvlab trainer)", ckpt);
    } else if (!strcmp(fam, "gpt2")) {
        rc = IS_ENABLED(CONFIG_GPT2) ? runner_open_gpt2(r, ckpt, batch_size, max_batches, seed, e)
                                     : err_set(e, "%s: a gpt2 checkpoint, but this mechint build has no gpt2 family "
                                                  "(hint: make mechint builds one per checkpoint config)", ckpt);
    } else if (!strcmp(fam, "vit")) {
        rc = IS_ENABLED(CONFIG_VIT) ? runner_open_vit(r, ckpt, batch_size, max_batches, seed, e)
                                    : err_set(e, "%s: a vit checkpoint, but this mechint build has no vit family "
                                                 "(hint: make mechint builds one per checkpoint config)", ckpt);
    } else if (!strcmp(fam, "seq2seq")) {
        rc = IS_ENABLED(CONFIG_SEQ2SEQ) ? runner_open_seq2seq(r, ckpt, batch_size, max_batches, seed, e)
                                        : err_set(e, "%s: a seq2seq checkpoint, but this mechint build has no seq2seq "
                                                     "family (hint: make mechint builds one per checkpoint config)", ckpt);
    } else {
        rc = err_set(e, "%s: unknown model family '%s'", ckpt, fam);
    }
    st_close(f);
    return rc;
}

void runner_close(Runner *r) {
    if (r->close) r->close(r);
    free(r->pos_table), free(r->host_params), free(r->host_logits);
    memset(r, 0, sizeof *r);
}

float *runner_logits(Runner *r) {
    size_t n = (size_t)r->rows * r->V;
    if (n > r->host_logits_cap) {
        free(r->host_logits);
        r->host_logits = xmalloc(n * sizeof(float));
        r->host_logits_cap = n;
    }
    act_download(r->host_logits, r->dev_logits, n);
    return r->host_logits;
}

void runner_backward(Runner *r, const float *dlogits) {
    act_upload(r->dev_logits, dlogits, (size_t)r->rows * r->V);
    r->backward(r);
}

void runner_layer(Runner *r, int l, const char *prefix, int index, int causal) {
    if (l < 0 || l >= RUNNER_MAX_LAYERS) FATAL("mechint: layer %d, at most %d layers", l, RUNNER_MAX_LAYERS);
    snprintf(r->name_store[l], sizeof r->name_store[l], "%.8s.%d", prefix, index);
    r->layer_names[l] = r->name_store[l];
    r->layer_causal[l] = causal;
}

void runner_setup(Runner *r, Params *w, const float *dev_pos, int npos, int C, const char *pos_kind) {
    r->w = w;
    w->attn_grads_only = 1; /* the analyses' gradients are the projections' (runner_backward) */
    r->host_params = params_to_host(w, w->params);
    if (dev_pos) {
        size_t n = (size_t)npos * C;
        float *pos = xmalloc(n * sizeof(float));
        dev_download(pos, dev_pos, n * sizeof(float));
        r->pos_table = xmalloc(n * sizeof(double));
        for (size_t i = 0; i < n; i++) r->pos_table[i] = pos[i];
        free(pos);
        r->npos = npos;
        r->pos_kind = pos_kind;
    }
}
