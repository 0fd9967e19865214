/* mechint: analyses of the attention circuits of one kvlab checkpoint.
 *
 *   mechint analyze --ckpt FILE --out DIR [--sha256 HEX]
 *   mechint attach --run-dir DIR --step STEP --report DIR --kind final|best
 *
 * Built by `make mechint` with the checkpoint's own resolved configuration
 * (so the model code is the trainer's, specialised the same way) plus the
 * MECHINT_* options of the current .config. Writes DIR/report.json (every
 * number, re-plottable) and DIR/report.md; scripts/mechint.py draws the
 * plots and the cross-checkpoint comparison. docs/mechint.md explains each
 * analysis. */
#define _GNU_SOURCE /* open_memstream */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>

#include "attention.h"
#include "buildinfo.h"
#include "common.h"
#include "probes.h"
#include "kernels.h"
#include "mechint.h"
#include "runner.h"
#include "safetensors.h"
#include "tracking.h"

#define REPORT_SCHEMA 1

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int parse_targets(const char *s, double *out, int cap) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        double v = strtod(p, &end);
        if (end == p || !(v > 0.0 && v < 1.0))
            FATAL("CONFIG_MECHINT_MASK_TARGETS=\"%s\": expected kept fractions in (0, 1) separated by commas (hint: "
                  "e.g. \"0.5,0.25\")", s);
        if (n == cap)
            FATAL("CONFIG_MECHINT_MASK_TARGETS=\"%s\": more than %d fractions (hint: each one trains its own masks; "
                  "keep at most %d)", s, cap, cap);
        out[n++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    if (n == 0) FATAL("CONFIG_MECHINT_MASK_TARGETS is empty (hint: e.g. \"0.5,0.25\")");
    return n;
}

/* Positions entering layer 0, centred per row as the first LayerNorm would. */
static void model_positions(Model *m, const Runner *r) {
    if (!r->pos_table) return;
    int n = r->npos, d = m->d;
    m->pos_table = xmalloc((size_t)n * d * sizeof(double));
    for (int i = 0; i < n; i++) {
        double mu = 0.0;
        for (int k = 0; k < d; k++) mu += r->pos_table[(size_t)i * d + k] / d;
        for (int k = 0; k < d; k++) m->pos_table[(size_t)i * d + k] = r->pos_table[(size_t)i * d + k] - mu;
    }
    m->npos = n;
    m->pos_kind = r->pos_kind;
    m->grid_w = r->grid_w, m->grid_h = r->grid_h, m->cls = r->cls;
}

static double get_num(const cJSON *o, const char *path) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *c = o;
    for (char *tok = strtok(buf, "."); tok && c; tok = strtok(NULL, ".")) c = cJSON_GetObjectItemCaseSensitive(c, tok);
    return c && cJSON_IsNumber(c) ? c->valuedouble : NAN;
}

static void md_num(FILE *f, const char *label, double v, const char *fmt) {
    fprintf(f, "| %s | ", label);
    if (isfinite(v))
        fprintf(f, fmt, v);
    else
        fprintf(f, "n/a");
    fprintf(f, " |\n");
}

static char *report_md(const cJSON *rep) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    const cJSON *a = cJSON_GetObjectItem(rep, "analyses");
    fprintf(f, "# mechint report: %s\n\n", cJSON_GetStringValue(cJSON_GetObjectItem(rep, "checkpoint")));
    fprintf(f, "- family: %s; attention: %s (%s)\n", cJSON_GetStringValue(cJSON_GetObjectItem(rep, "family")),
            cJSON_GetStringValue(cJSON_GetObjectItem(rep, "variant_label")),
            cJSON_GetStringValue(cJSON_GetObjectItem(rep, "roles")));
    fprintf(f, "- weights: %s\n", cJSON_GetStringValue(cJSON_GetObjectItem(rep, "weights")));
    fprintf(f, "- held-out data: %s (seed %d)\n", cJSON_GetStringValue(cJSON_GetObjectItem(rep, "data")),
            (int)get_num(rep, "seed"));
    fprintf(f, "- sha256: %s\n\n", cJSON_GetStringValue(cJSON_GetObjectItem(rep, "sha256")));
    fprintf(f, "| metric | value |\n|---|---|\n");
    md_num(f, "A1 mean effective rank of W_QK", get_num(a, "circuits.summary.mean_erank_qk"), "%.2f");
    md_num(f, "A1 mean effective rank of W_OV", get_num(a, "circuits.summary.mean_erank_ov"), "%.2f");
    md_num(f, "A2 mean QK symmetry sigma_sym (1 = symmetric)", get_num(a, "qk_symmetry.summary.mean_sigma_sym"), "%.4f");
    md_num(f, "A3 mean K-V subspace overlap PK (random r/d)", get_num(a, "kv_alignment.summary.mean_pk"), "%.4f");
    md_num(f, "A3 mean tieability residual tau_QK (0 = K:=V loses nothing)",
           get_num(a, "kv_alignment.summary.mean_tau_qk"), "%.4f");
    md_num(f, "A5 layer-0 previous-token margin mu_prev (mean)", get_num(a, "pos_kernel.summary.mean_mu_prev"), "%.4f");
    md_num(f, "A7 mean antisymmetric share of logits", get_num(a, "attn_asymmetry.summary.mean_antisym_share"), "%.4f");
    md_num(f, "A7 mean curl share (irreducible asymmetry)", get_num(a, "attn_asymmetry.summary.mean_curl_share"), "%.4f");
    md_num(f, "A8 induction loss on the repeated copy (nats)",
           get_num(a, "head_types.summary.induction_loss_second_copy"), "%.4f");
    md_num(f, "A9 largest K-composition z (a head reading an earlier head's output as keys)",
           get_num(a, "composition.summary.max_z_k"), "%.2f");
    md_num(f, "A9 largest V-composition z", get_num(a, "composition.summary.max_z_v"), "%.2f");
    md_num(f, "A10 clean loss", get_num(a, "ablation.summary.clean_loss"), "%.4f");
    md_num(f, "A10 largest mean-ablation loss increase", get_num(a, "ablation.summary.max_dloss_mean"), "%.4f");
    md_num(f, "A10 heads carrying 90% of the ablation effect", get_num(a, "ablation.summary.heads_for_90pct_of_effect"),
           "%.0f");
    const cJSON *census = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(a, "head_types"), "summary"), "census");
    if (census) {
        fprintf(f, "\nHead census (A8): ");
        const cJSON *c;
        cJSON_ArrayForEach(c, census) fprintf(f, "%s %d; ", c->string, (int)c->valuedouble);
        fprintf(f, "\n");
    }
    const cJSON *curve = cJSON_GetObjectItem(cJSON_GetObjectItem(a, "kv_masks"), "curve");
    if (curve) {
        fprintf(f, "\nA11 K/V masks (faithfulness 1 = as the full model, 0 = as with every masked direction off):\n\n");
        fprintf(f, "| target kept | kept | KL | faithfulness | magnitude baseline | random baseline |\n|---|---|---|---|---|---|\n");
        const cJSON *pt;
        cJSON_ArrayForEach(pt, curve) fprintf(f, "| %.2f | %.3f | %.4f | %.3f | %.3f | %.3f |\n", get_num(pt, "target_kept"),
                                              get_num(pt, "kept"), get_num(pt, "kl"), get_num(pt, "faithfulness"),
                                              get_num(pt, "magnitude_faithfulness"),
                                              get_num(pt, "random_faithfulness_mean"));
    }
    fprintf(f, "\nNot applicable here:\n\n");
    const cJSON *an;
    int none = 1;
    cJSON_ArrayForEach(an, a) if (cJSON_IsFalse(cJSON_GetObjectItem(an, "applies"))) {
        fprintf(f, "- %s: %s\n", an->string, cJSON_GetStringValue(cJSON_GetObjectItem(an, "why")));
        none = 0;
    }
    if (none) fprintf(f, "- (none)\n");
    fprintf(f, "\nPlots are in this folder; docs/mechint.md explains every number.\n");
    fclose(f);
    return buf;
}

static void add_step(cJSON *rep, const char *id, cJSON *res, double t0) {
    cJSON_AddItemToObject(cJSON_GetObjectItem(rep, "analyses"), id, res);
    fprintf(stderr, "  %-28s done (%.1f s)\n", id, now_s() - t0);
}

static int analyze(const char *ckpt, const char *out, const char *sha) {
    Err e;
    Runner r;
    int batches = CONFIG_MECHINT_BATCHES, mask_batches = CONFIG_MECHINT_MASK_BATCHES;
    uint64_t seed = CONFIG_MECHINT_SEED;
    if (runner_open(&r, ckpt, CONFIG_MECHINT_BATCH_SIZE, batches > mask_batches ? batches : mask_batches, seed, &e) != 0) {
        fprintf(stderr, "error: %s\n", e.msg);
        return 1;
    }
    Model m;
    model_build(&m, r.family, &r.src);
    model_positions(&m, &r);
    cJSON *rep = cJSON_CreateObject();
    cJSON_AddNumberToObject(rep, "schema", REPORT_SCHEMA);
    cJSON_AddStringToObject(rep, "checkpoint", ckpt);
    cJSON_AddStringToObject(rep, "sha256", sha ? sha : "");
    cJSON_AddStringToObject(rep, "family", r.family);
    cJSON_AddStringToObject(rep, "variant", attn_variant_id(m.variant, m.pos));
    cJSON_AddStringToObject(rep, "variant_label", attn_variant_label(m.variant, m.pos));
    cJSON_AddStringToObject(rep, "roles", attn_variants[m.variant].roles);
    /* what the weight analyses do not see under a position scheme acting inside attention */
    if (ATTN_POSITION == ATTN_POSITION_ROPE)
        cJSON_AddStringToObject(rep, "positions_note",
                                "RoPE: A1-A3 and A11's key directions analyse the content circuit W_Q W_K^T, the "
                                "circuit at offset 0; the scores of offset d = j - i use W_Q R_d W_K^T, which "
                                "depends on d (A7, A8, A10 measure attention with the rotation, on data)");
    else if (attn_positions[ATTN_POSITION].where == ATTN_PE_BIAS)
        cJSON_AddStringToObject(rep, "positions_note",
                                "a per-head bias b_h(j - i) (ALiBi or the learned relative bias) adds to every "
                                "score beside the circuits A1-A3 analyse; A7, A8, A10 see it, on data");
    cJSON_AddStringToObject(rep, "weights", r.src.post_ln ? "raw (post-LN blocks cannot be folded)"
                                                          : "LayerNorm gain and bias folded into W_Q/W_K/W_V");
    cJSON_AddStringToObject(rep, "data", r.data_desc);
    cJSON_AddNumberToObject(rep, "seed", (double)seed);
    StFile *f = st_open(ckpt, &e);
    if (f) {
        const char *keys[] = {"ablation_step", "step", "val_loss", "best_val_loss", "dataset", "model"};
        cJSON *meta = cJSON_CreateObject();
        for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
            const char *v = st_meta(f, keys[k]);
            if (!v) continue;
            cJSON *j = !strcmp(keys[k], "model") ? cJSON_Parse(v) : NULL;
            cJSON_AddItemToObject(meta, keys[k], j ? j : cJSON_CreateString(v));
        }
        cJSON_AddItemToObject(rep, "checkpoint_meta", meta);
        st_close(f);
    }
    cJSON *layers = cJSON_CreateArray();
    for (int l = 0; l < m.L; l++) cJSON_AddItemToArray(layers, cJSON_CreateString(m.layer[l].name));
    cJSON_AddItemToObject(rep, "layers", layers);
    cJSON_AddNumberToObject(rep, "n_layer", m.L);
    cJSON_AddNumberToObject(rep, "n_head", m.H);
    cJSON_AddNumberToObject(rep, "head_dim", m.r);
    cJSON_AddItemToObject(rep, "analyses", cJSON_CreateObject());
    fprintf(stderr, "mechint: %s (%s, %s, %d layers x %d heads)\n", ckpt, r.family, attn_variant_label(m.variant, m.pos),
            m.L, m.H);
    double t0 = now_s();
    if (IS_ENABLED(CONFIG_MECHINT_WEIGHTS)) {
        add_step(rep, "circuits", analysis_circuits(&m), t0);
        add_step(rep, "qk_symmetry", analysis_qk_symmetry(&m), t0);
        add_step(rep, "kv_alignment", analysis_kv_alignment(&m), t0);
        add_step(rep, "pos_kernel", analysis_pos_kernel(&m), t0);
        add_step(rep, "pos_bias", analysis_pos_bias(&m, CONFIG_MECHINT_POS_GRID), t0);
        add_step(rep, "composition", analysis_composition(&m, seed), t0);
    }
    if (IS_ENABLED(CONFIG_MECHINT_PATTERNS)) {
        cJSON *maps = NULL;
        cJSON *both = analysis_patterns(&r, &m, batches, CONFIG_MECHINT_PATTERN_SEQS, CONFIG_MECHINT_INDUCTION_LEN, seed,
                                        &maps);
        add_step(rep, "attn_asymmetry", cJSON_DetachItemFromObject(both, "attn_asymmetry"), t0);
        add_step(rep, "head_types", cJSON_DetachItemFromObject(both, "head_types"), t0);
        cJSON_AddItemToObject(rep, "attention_maps", maps);
        cJSON_Delete(both);
    }
    if (IS_ENABLED(CONFIG_MECHINT_ABLATION)) add_step(rep, "ablation", analysis_ablation(&r, &m, batches), t0);
    if (IS_ENABLED(CONFIG_MECHINT_MASKS)) {
        double targets[16];
        int nt = parse_targets(CONFIG_MECHINT_MASK_TARGETS, targets, 16);
        add_step(rep, "kv_masks",
                 analysis_masks(&r, &m, mask_batches, targets, nt, CONFIG_MECHINT_MASK_STEPS,
                                KCONFIG_NUMBER(CONFIG_MECHINT_MASK_LR, 1e-6, 10.0), seed),
                 t0);
    }
    cJSON_AddNumberToObject(rep, "seconds", now_s() - t0);
    mkdir(out, 0777);
    char path[4096];
    char *js = cJSON_Print(rep), *md = report_md(rep);
    snprintf(path, sizeof path, "%s/report.json", out);
    int rc = write_file_atomic(path, js, strlen(js), &e);
    if (!rc) {
        snprintf(path, sizeof path, "%s/report.md", out);
        rc = write_file_atomic(path, md, strlen(md), &e);
    }
    if (rc) fprintf(stderr, "error: %s\n", e.msg);
    free(js), free(md);
    cJSON_Delete(rep);
    model_free(&m);
    runner_close(&r);
    return rc ? 1 : 0;
}

/* Attaches a finished report to the W&B run of the step it analysed: the summary numbers of every analysis as
 * mechint/<kind>/<analysis>/<key>, and report.{md,json} plus the plots as files under mechint/<checkpoint>/.
 * Nothing happens when that step was trained without tracking. */
static int attach(const char *run_dir, const char *step, const char *dir, const char *kind) {
    char path[4096];
    snprintf(path, sizeof path, "%s/report.json", dir);
    Err e;
    char *text = read_file(path, NULL, &e);
    cJSON *rep = text ? cJSON_Parse(text) : NULL;
    int was_read = text != NULL;
    free(text);
    if (!cJSON_IsObject(rep)) {
        /* read_file's message names the path itself */
        if (!was_read)
            fprintf(stderr, "error: %s (hint: make mechint writes the report before it attaches it)\n", e.msg);
        else
            fprintf(stderr, "error: %s: %s (hint: the report was damaged; run make mechint again to rewrite it)\n",
                    path, rep ? "not a JSON object" : "not valid JSON");
        cJSON_Delete(rep);
        return 1;
    }
    cJSON *flat = cJSON_CreateObject();
    const cJSON *an;
    cJSON_ArrayForEach(an, cJSON_GetObjectItem(rep, "analyses")) {
        const cJSON *v;
        cJSON_ArrayForEach(v, cJSON_GetObjectItem(an, "summary")) {
            if (!cJSON_IsNumber(v)) continue;
            char key[512];
            snprintf(key, sizeof key, "mechint/%s/%s/%s", kind, an->string, v->string);
            cJSON_AddNumberToObject(flat, key, v->valuedouble);
        }
    }
    cJSON_Delete(rep);
    char *summary = cJSON_PrintUnformatted(flat);
    cJSON_Delete(flat);
    char *files[64];
    int nf = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)) && nf < 64) {
        const char *x = strrchr(de->d_name, '.');
        if (!x || de->d_name[0] == '.' || (strcmp(x, ".png") && strcmp(de->d_name, "report.md") && strcmp(de->d_name, "report.json")))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        files[nf] = strdup(path);
        nf++;
    }
    if (d) closedir(d);
    char folder[512];
    const char *stem = strrchr(dir, '/');
    snprintf(folder, sizeof folder, "mechint/%s", stem && stem[1] ? stem + 1 : dir);
    int rc = tracking_attach_results(run_dir, step, summary, (const char *const *)files, nf, folder);
    if (rc == 0) printf("   attached to the W&B run of step %s (%d files)\n", step, nf);
    for (int i = 0; i < nf; i++) free(files[i]);
    free(summary);
    return rc < 0 ? 1 : 0;
}

static void usage(void) {
    fprintf(stderr, "usage: mechint analyze --ckpt FILE --out DIR [--sha256 HEX]\n"
                    "       mechint attach --run-dir DIR --step STEP --report DIR --kind final|best\n"
                    "(normally run through `make mechint`, which builds mechint for each checkpoint's configuration)\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    int analyse = !strcmp(argv[1], "analyze");
    if (!analyse && strcmp(argv[1], "attach") != 0) usage();
    const char *ckpt = NULL, *out = NULL, *sha = NULL, *run_dir = NULL, *step = NULL, *kind = NULL;
    for (int i = 2; i < argc; i++) {
        const char **slot = !strcmp(argv[i], "--ckpt")      ? &ckpt
                            : !strcmp(argv[i], "--out")     ? &out
                            : !strcmp(argv[i], "--sha256")  ? &sha
                            : !strcmp(argv[i], "--run-dir") ? &run_dir
                            : !strcmp(argv[i], "--step")    ? &step
                            : !strcmp(argv[i], "--report")  ? &out
                            : !strcmp(argv[i], "--kind")    ? &kind
                                                            : NULL;
        if (!slot || i + 1 >= argc) usage_refuse(argv[i]), usage();
        *slot = argv[++i];
    }
    if (!analyse) {
        if (!run_dir || !step || !out || !kind) usage();
        return attach(run_dir, step, out, kind);
    }
    if (!ckpt || !out) usage();
    backend_init(CONFIG_NUM_THREADS);
    return analyze(ckpt, out, sha);
}
