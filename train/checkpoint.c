#include "checkpoint.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "kernels.h"

static StTensorIn tensor_in(const ParamSpec *s, const char *name, const float *base) {
    StTensorIn in = {.name = name, .dtype = ST_F32, .ndim = s->ndim, .data = base + s->offset};
    for (int d = 0; d < s->ndim; d++) in.shape[d] = s->shape[d];
    return in;
}

/* CRC-32 (zlib's) of a tensor's bytes as stored in the file (the host is
 * little-endian, as safetensors), as 8 lowercase hex digits. */
static void tensor_crc(const float *x, size_t numel, char hex[16]) {
    uLong crc = crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)x, numel * sizeof(float));
    snprintf(hex, 16, "%08lx", (unsigned long)crc);
}

/* {"<tensor name>": "<crc32, 8 hex digits>", ...} for metadata CHECKPOINT_CRC_KEY. */
static char *crc_json(const StTensorIn *in, int n) {
    cJSON *o = cJSON_CreateObject();
    for (int i = 0; i < n; i++) {
        char hex[16];
        size_t numel = 1;
        for (int d = 0; d < in[i].ndim; d++) numel *= (size_t)in[i].shape[d];
        tensor_crc(in[i].data, numel, hex);
        cJSON_AddStringToObject(o, in[i].name, hex);
    }
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

int checkpoint_finite(const char *path, const ParamTable *t, const float *params, const float *m, const float *v,
                      Err *e) {
    const float *arrays[3] = {params, m, v};
    static const char *const prefix[3] = {"", "optim.m.", "optim.v."};
    for (int a = 0; a < 3; a++)
        for (int i = 0; arrays[a] && i < t->n; i++) {
            const ParamSpec *s = &t->specs[i];
            for (size_t k = 0; k < s->numel; k++)
                if (!isfinite(arrays[a][s->offset + k]))
                    return err_set(e, "%s: not written: tensor '%s%s' holds a non-finite value at index %zu (hint: "
                                      "the run diverged; the file there is kept: lower the learning rate or clip "
                                      "the gradients)", path, prefix[a], s->name, k);
        }
    return 0;
}

int checkpoint_save(const char *path, const ParamTable *t, const float *params, const float *m, const float *v,
                    const StMeta *meta, int nmeta, Err *e) {
    int per = m && v ? 3 : 1;
    StTensorIn *in = xmalloc((size_t)t->n * per * sizeof(StTensorIn));
    char (*names)[PARAM_NAME_MAX + 8] = xmalloc((size_t)t->n * per * sizeof *names);
    int n = 0;
    for (int i = 0; i < t->n; i++) {
        in[n] = tensor_in(&t->specs[i], t->specs[i].name, params);
        n++;
        if (per == 3) {
            snprintf(names[n], sizeof names[n], "optim.m.%s", t->specs[i].name);
            in[n] = tensor_in(&t->specs[i], names[n], m);
            n++;
            snprintf(names[n], sizeof names[n], "optim.v.%s", t->specs[i].name);
            in[n] = tensor_in(&t->specs[i], names[n], v);
            n++;
        }
    }
    char *crcs = crc_json(in, n);
    StMeta *all = xmalloc((size_t)(nmeta + 3) * sizeof(StMeta));
    all[0] = (StMeta){"framework", "kvlab"};
    all[1] = (StMeta){"format_version", CHECKPOINT_FORMAT_VERSION};
    all[2] = (StMeta){CHECKPOINT_CRC_KEY, crcs};
    memcpy(all + 3, meta, (size_t)nmeta * sizeof(StMeta));
    int rc = st_save(path, in, n, all, nmeta + 3, e);
    free(all);
    free(crcs);
    free(names);
    free(in);
    return rc;
}

StFile *checkpoint_open(const char *path, const char *family, Err *e) {
    StFile *f = st_open(path, e);
    if (!f) return NULL;
    const char *fw = st_meta(f, "framework"), *ver = st_meta(f, "format_version"), *fam = st_meta(f, "family");
    if (!fw || strcmp(fw, "kvlab") != 0) {
        err_set(e, "%s: not a kvlab checkpoint (safetensors without kvlab metadata) (hint: kvlab reads only "
                   "checkpoints it wrote; check the path)", path);
    } else if (!ver || strcmp(ver, CHECKPOINT_FORMAT_VERSION) != 0) {
        err_set(e, "%s: checkpoint format version %s, this build reads version %s (hint: use the kvlab version "
                   "that wrote it)", path, ver ? ver : "(missing)", CHECKPOINT_FORMAT_VERSION);
    } else if (!fam || strcmp(fam, family) != 0) {
        err_set(e, "%s: checkpoint of model family '%s', expected '%s' (hint: use that family's binary)", path,
                fam ? fam : "(missing)", family);
    } else {
        return f;
    }
    st_close(f);
    return NULL;
}

int checkpoint_expect(StFile *f, const char *key, const char *want, const char *hint, Err *e) {
    const char *got = st_meta(f, key);
    if (got && strcmp(got, want) == 0) return 0;
    return err_set(e, "%s: mismatched checkpoint: %s is '%s', this binary has '%s' (hint: %s)", st_path(f), key,
                   got ? got : "(missing)", want, hint);
}

/* First field (dotted path) where got differs from want, or 0 when equal. A
 * field that only the stored description has is a difference too (*want_s
 * NULL): descriptions write some fields only when they are not the standard
 * (attention.kv_heads when K/V heads are grouped), so that older checkpoints
 * keep loading and a model that has one is still told apart. */
static int json_diff(const cJSON *got, const cJSON *want, char *path, size_t cap, char **got_s, char **want_s) {
    if (cJSON_IsObject(want) && cJSON_IsObject(got)) {
        size_t len = strlen(path);
        const cJSON *w;
        cJSON_ArrayForEach(w, want) {
            snprintf(path + len, cap - len, "%s%s", len ? "." : "", w->string);
            if (json_diff(cJSON_GetObjectItemCaseSensitive(got, w->string), w, path, cap, got_s, want_s)) return 1;
        }
        cJSON_ArrayForEach(w, got) {
            if (cJSON_GetObjectItemCaseSensitive(want, w->string)) continue;
            snprintf(path + len, cap - len, "%s%s", len ? "." : "", w->string);
            *got_s = cJSON_PrintUnformatted(w);
            *want_s = NULL;
            return 1;
        }
        path[len] = 0;
        return 0;
    }
    if (got && cJSON_Compare(got, want, 1)) return 0;
    *got_s = got ? cJSON_PrintUnformatted(got) : NULL;
    *want_s = cJSON_PrintUnformatted(want);
    return 1;
}

int checkpoint_expect_json(StFile *f, const char *key, const char *want_json, const char *hint, Err *e) {
    const char *text = st_meta(f, key);
    cJSON *got = text ? cJSON_Parse(text) : NULL, *want = cJSON_Parse(want_json);
    char path[256] = "", *got_s = NULL, *want_s = NULL;
    int rc = 0;
    if (!want) FATAL("checkpoint_expect_json: invalid JSON for %s", key);
    if (!got)
        rc = err_set(e, "%s: metadata '%s' is missing or not JSON (hint: %s)", st_path(f), key, hint);
    else if (json_diff(got, want, path, sizeof path, &got_s, &want_s))
        rc = err_set(e, "%s: mismatched checkpoint: %s.%s is %s, this binary has %s (hint: %s)", st_path(f), key, path,
                     got_s ? got_s : "(missing)", want_s ? want_s : "none", hint);
    cJSON_free(got_s);
    cJSON_free(want_s);
    cJSON_Delete(got);
    cJSON_Delete(want);
    return rc;
}

/* Checks the tensor just read against its checksum in crcs (the parsed
 * CHECKPOINT_CRC_KEY metadata; NULL for files written before checksums). */
static int check_crc(StFile *f, const cJSON *crcs, const char *name, const float *x, size_t numel, Err *e) {
    if (!crcs) return 0;
    const cJSON *want = cJSON_GetObjectItemCaseSensitive(crcs, name);
    if (!cJSON_IsString(want))
        return err_set(e, "%s: tensor '%s' has no checksum in metadata '%s' (hint: the header was damaged or edited; "
                          "use another copy of the checkpoint)", st_path(f), name, CHECKPOINT_CRC_KEY);
    char got[16];
    tensor_crc(x, numel, got);
    if (strcmp(got, want->valuestring) != 0)
        return err_set(e, "%s: tensor '%s' does not match its checksum (CRC-32 %s, the file says %s): its bytes changed "
                          "after the checkpoint was written (hint: the file is damaged (disk, copy or transfer); use "
                          "another copy or an earlier checkpoint)", st_path(f), name, got, want->valuestring);
    return 0;
}

static int read_one(StFile *f, const ParamSpec *s, const char *name, float *dst, const cJSON *crcs, Err *e) {
    const StTensorInfo *ti = st_find(f, name);
    if (!ti)
        return err_set(e, "%s: tensor '%s' is missing (hint: the checkpoint is from a different model shape or "
                          "variant; use the binary of the step that wrote it)", st_path(f), name);
    if (st_read_f32(f, name, s->ndim, s->shape, dst, e) != 0) return -1;
    if (check_crc(f, crcs, name, dst, s->numel, e) != 0) return -1;
    for (size_t k = 0; k < s->numel; k++)
        if (!isfinite(dst[k]))
            return err_set(e, "%s: tensor '%s' holds a non-finite value at index %zu (hint: the run that wrote it "
                              "diverged; use an earlier checkpoint)", st_path(f), name, k);
    return 0;
}

int checkpoint_read(StFile *f, const ParamTable *t, float *params, float *m, float *v, Err *e) {
    char name[PARAM_NAME_MAX + 16];
    const char *crc_text = st_meta(f, CHECKPOINT_CRC_KEY);
    cJSON *crcs = crc_text ? cJSON_Parse(crc_text) : NULL;
    int rc = 0;
    if (crc_text && !cJSON_IsObject(crcs))
        rc = err_set(e, "%s: metadata '%s' is not a JSON object (hint: the header was damaged or edited; use another "
                        "copy of the checkpoint)", st_path(f), CHECKPOINT_CRC_KEY);
    for (int i = 0; i < t->n && rc == 0; i++) {
        const ParamSpec *s = &t->specs[i];
        rc = read_one(f, s, s->name, params + s->offset, crcs, e);
        if (rc == 0 && m && v) {
            snprintf(name, sizeof name, "optim.m.%s", s->name);
            rc = read_one(f, s, name, m + s->offset, crcs, e);
            snprintf(name, sizeof name, "optim.v.%s", s->name);
            if (rc == 0) rc = read_one(f, s, name, v + s->offset, crcs, e);
        }
    }
    cJSON_Delete(crcs);
    if (rc != 0) return -1;
    /* nothing unexpected: every tensor is a parameter or one of its moments */
    for (int i = 0; i < st_count(f); i++) {
        const char *n = st_get(f, i)->name;
        const char *base = strncmp(n, "optim.m.", 8) == 0 || strncmp(n, "optim.v.", 8) == 0 ? n + 8 : n;
        if (!param_find(t, base))
            return err_set(e, "%s: unexpected tensor '%s' (hint: the checkpoint is from a different model shape or "
                              "variant; use the binary of the step that wrote it)", st_path(f), n);
    }
    return 0;
}

/* ------------------------------------------------------------------ a model's device buffers */

int checkpoint_save_params(const char *path, const Params *p, int moments, const StMeta *meta, int nmeta, Err *e) {
    float *params = params_to_host(p, p->params);
    float *m = moments ? params_to_host(p, p->m) : NULL, *v = moments ? params_to_host(p, p->v) : NULL;
    int rc = checkpoint_save(path, &p->table, params, m, v, meta, nmeta, e);
    free(params), free(m), free(v);
    return rc;
}

int checkpoint_read_params(StFile *f, Params *p, int moments, Err *e) {
    size_t n = p->table.total;
    float *host = xcalloc((moments ? 3 : 1) * n, sizeof(float)); /* zero: the table's alignment gaps */
    float *m = moments ? host + n : NULL, *v = moments ? host + 2 * n : NULL;
    int rc = checkpoint_read(f, &p->table, host, m, v, e);
    if (rc == 0) { /* all or nothing: a bad file leaves the model as it was */
        params_from_host(p, p->params, host);
        if (moments) params_from_host(p, p->m, m), params_from_host(p, p->v, v);
    }
    free(host);
    return rc;
}

int checkpoint_load_model(const char *path, const char *family, const char *variant, const char *variant_hint,
                          const char *model_json, const char *model_hint, const char *dataset, const char *tokenizer,
                          Params *p, Err *e) {
    static const char *data_hint = "the checkpoint was trained on other data; use the binary of the step that "
                                   "wrote it (output/<run>/train_<family>_step<STEP>)";
    StFile *f = checkpoint_open(path, family, e);
    if (!f) return -1;
    int rc = checkpoint_expect(f, "variant", variant, variant_hint, e) != 0 ||
                     checkpoint_expect_json(f, "model", model_json, model_hint, e) != 0 ||
                     (dataset && checkpoint_expect(f, "dataset", dataset, data_hint, e) != 0)
                 ? -1
                 : 0;
    const char *got = st_meta(f, "tokenizer");
    if (rc == 0 && tokenizer && (!got || strcmp(got, tokenizer) != 0)) /* a vocabulary may be long: not printed */
        rc = err_set(e, "%s: mismatched checkpoint: its tokenizer (metadata 'tokenizer', %zu bytes) is not this "
                        "binary's (%zu bytes) (hint: %s)", st_path(f), got ? strlen(got) : 0, strlen(tokenizer),
                     data_hint);
    if (rc == 0 && checkpoint_read_params(f, p, 0, e) != 0) rc = -1;
    st_close(f);
    return rc;
}
