/* Opening a checkpoint for analysis: its family picks the runner. */
#include <stdlib.h>
#include <string.h>

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
    free(r->pos_table);
    memset(r, 0, sizeof *r);
}

int runner_counted(const int *targets, int rows) {
    int n = 0;
    for (int i = 0; i < rows; i++) n += targets[i] >= 0;
    return n;
}
