/* Experiment tracking hooks of the trainer (train/tracking.h, docs/wandb.md). */
#include "tracking.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "buildinfo.h"
#include "wandb.h"

/* Built only when CONFIG_WANDB is on (train/Makefile): its symbols exist. */

static const char *nonempty(const char *s) { return s && *s ? s : NULL; }

/* The Kconfig defaults (mode, project, entity, tags, server). Environment
 * variables still override them (docs/wandb.md). */
static void tracking_settings(WandbSettings *s) {
    memset(s, 0, sizeof *s);
    s->mode = IS_ENABLED(CONFIG_WANDB_OFFLINE) ? "offline" : IS_ENABLED(CONFIG_WANDB_ONLINE) ? "online" : "disabled";
    s->project = nonempty(CONFIG_WANDB_PROJECT);
    s->entity = nonempty(CONFIG_WANDB_ENTITY);
    s->tags = nonempty(CONFIG_WANDB_TAGS);
    /* the client prefers an explicit URL to $WANDB_BASE_URL; the environment must win over Kconfig */
    const char *env_url = getenv("WANDB_BASE_URL");
    s->base_url = env_url && *env_url ? NULL : nonempty(CONFIG_WANDB_BASE_URL);
}

/* The display name from the Kconfig template: {run}, {step}, {family}, {variant}. */
static void expand_name(const TrainRun *r, char *out, size_t n) {
    const char *names[] = {"{run}", "{step}", "{family}", "{variant}"};
    const char *values[] = {CONFIG_RUN_NAME, r->step, r->family, r->variant};
    size_t k = 0;
    for (const char *p = CONFIG_WANDB_RUN_NAME; *p && k + 1 < n;) {
        int hit = 0;
        for (int i = 0; i < 4 && !hit; i++) {
            size_t len = strlen(names[i]);
            if (!strncmp(p, names[i], len)) {
                k += (size_t)snprintf(out + k, n - k, "%s", values[i] ? values[i] : "");
                if (k >= n) k = n - 1;
                p += len;
                hit = 1;
            }
        }
        if (!hit) out[k++] = *p++;
    }
    out[k] = 0;
}

static void add_json(cJSON *o, const char *key, const char *text) {
    cJSON *v = text ? cJSON_Parse(text) : NULL;
    cJSON_AddItemToObject(o, key, v ? v : cJSON_CreateNull());
}

void tracking_start(TrainRun *r) {
    if (r->wandb) return;
    WandbSettings s;
    tracking_settings(&s);
    char name[256], tags[1024], dir[4200];
    expand_name(r, name, sizeof name);
    snprintf(tags, sizeof tags, "%s,%s%s%s", r->family, r->variant ? r->variant : "", s.tags ? "," : "",
             s.tags ? s.tags : "");
    snprintf(dir, sizeof dir, "%s/wandb/%s", r->out, r->step);
    /* the W&B config: every CONFIG_ value, then what the run is */
    cJSON *cfg = cJSON_Parse(build_config_json());
    if (!cJSON_IsObject(cfg)) {
        cJSON_Delete(cfg);
        cfg = cJSON_CreateObject();
    }
    cJSON_AddStringToObject(cfg, "family", r->family);
    cJSON_AddStringToObject(cfg, "variant", r->variant ? r->variant : "");
    cJSON_AddStringToObject(cfg, "step", r->step);
    cJSON_AddStringToObject(cfg, "dataset", r->dataset ? r->dataset : "");
    cJSON_AddStringToObject(cfg, "unit", r->unit ? r->unit : "");
    cJSON_AddNumberToObject(cfg, "seed", (double)r->seed);
    cJSON_AddNumberToObject(cfg, "parameters", r->w ? (double)r->w->table.count : 0.0);
    add_json(cfg, "model", r->model_json);
    char *cfg_text = cJSON_PrintUnformatted(cfg);
    cJSON_Delete(cfg);
    s.name = name;
    s.group = CONFIG_RUN_NAME;
    s.job_type = r->step;
    s.tags = tags;
    s.commit = build_git_commit();
    s.dir = dir;
    s.config_json = cfg_text;
    /* a run should not wait long at its start for a server that is down */
    const char *t = getenv("WANDB_INIT_TIMEOUT");
    s.init_timeout_s = t && *t ? 0 : 30;
    r->wandb = wandb_init(&s);
    free(cfg_text);
}

/* Series of the metrics documents (all families) -> W&B keys; '/' groups the charts. */
static const char *const KEYS[][2] = {
    {"train_losses", "train/loss"},
    {"train_perplexities", "train/perplexity"},
    {"train_accuracies", "train/accuracy"},
    {"learning_rates", "train/lr"},
    {"grad_norms", "train/grad_norm"},
    {"train_epoch_losses", "train/epoch_loss"},
    {"train_epoch_accuracies", "train/epoch_accuracy"},
    {"epochs", "train/epoch"},
    {"tokens", "perf/tokens"},
    {"images", "perf/images"},
    {"sequences", "perf/sequences"},
    {"tokens_per_s", "perf/tokens_per_s"},
    {"images_per_s", "perf/images_per_s"},
    {"sequences_per_s", "perf/sequences_per_s"},
    {"ms_per_iter", "perf/ms_per_iter"},
    {"val_losses", "val/loss"},
    {"val_perplexities", "val/perplexity"},
    {"val_accuracies", "val/accuracy"},
    {"val_bleus", "val/bleu"},
    {"val_jobs", "val/job"},
    {"val_tokens", "val/tokens"},
    {"val_images", "val/images"},
    /* the step and the run time are W&B's own _step and _runtime */
    {"iterations", NULL},
    {"val_iterations", NULL},
    {"timestamps", NULL},
    {"val_timestamps", NULL},
};

static const char *key_of(const char *series, char *buf, size_t n) {
    for (size_t i = 0; i < sizeof KEYS / sizeof *KEYS; i++)
        if (!strcmp(series, KEYS[i][0])) return KEYS[i][1];
    /* a series added later: val_* under val/, anything else under train/ */
    if (!strncmp(series, "val_", 4))
        snprintf(buf, n, "val/%s", series + 4);
    else
        snprintf(buf, n, "train/%s", strncmp(series, "train_", 6) ? series : series + 6);
    return buf;
}

void tracking_log(TrainRun *r) {
    const MetricsValue *v;
    int n = metrics_fresh(r->metrics, &v); /* taken even when off, so the list stays short */
    if (!r->wandb) return;
    for (int i = 0; i < n; i++) {
        char buf[128];
        const char *key = key_of(v[i].series, buf, sizeof buf);
        if (key) wandb_log(r->wandb, r->iter, key, v[i].value);
    }
}

void tracking_finish(TrainRun *r, int exit_code) {
    if (!r->wandb) return;
    tracking_log(r);
    char per_s[64];
    snprintf(per_s, sizeof per_s, "%s_per_s", r->unit ? r->unit : "tokens");
    /* the facts of the metrics document that compare steps; absent ones are skipped */
    const char *const facts[] = {"best_val_loss", "best_val_iteration", "final_val_loss", "final_iteration",
                                 "test_accuracy", "best_model_test_accuracy", "test_loss", "test_bleu",
                                 "parameters", "flops_per_token", "kv_cache_bytes_per_token", "peak_memory_mib",
                                 "ms_per_iter", "train_seconds", "wall_seconds", "decode_tokens_per_s", per_s};
    for (size_t i = 0; i < sizeof facts / sizeof *facts; i++) {
        double x = metrics_get_number(r->metrics, facts[i]);
        char key[96];
        snprintf(key, sizeof key, "final/%s", facts[i]);
        if (!isnan(x)) wandb_summary_set(r->wandb, key, x);
    }
    const char *base = strrchr(r->metrics_path, '/');
    wandb_upload_file(r->wandb, r->metrics_path, base ? base + 1 : r->metrics_path);
    wandb_finish(r->wandb, exit_code);
    r->wandb = NULL;
}

int tracking_attach_results(const char *run_dir, const char *step, const char *summary_json,
                            const char *const *files, int nfiles, const char *folder) {
    WandbSettings s;
    tracking_settings(&s);
    char root[4200];
    snprintf(root, sizeof root, "%s/wandb/%s", run_dir, step);
    Err e;
    int rc = wandb_attach_spool(root, summary_json, files, nfiles, folder, &s, &e);
    if (rc < 0) fprintf(stderr, "wandb: %s\n", e.msg);
    return rc;
}
