/* train_vit: trains and evaluates the ViT this binary was built for (one
 * binary per ablation step; everything comes from the build configuration).
 *
 *   train_vit train --out DIR --step NAME     train (resuming from DIR's checkpoint of the step),
 *                                             then test the final and the best-validation model; --set NAME=VALUE
 *                                             replaces a run-time symbol (lib/runconfig.h)
 *   train_vit eval --ckpt FILE                test accuracy and confusion matrix of a checkpoint
 *   train_vit info                            configuration, parameters, FLOPs
 *
 * Each epoch trains on a seeded permutation of the training images, then
 * measures the validation images (never trained on); the test set is used
 * only at the end. Files as train_gpt2 (train/trainer.h). */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "buildinfo.h"
#include "checkpoint.h"
#include "common.h"
#include "data.h"
#include "dist.h"
#include "kernels.h"
#include "metrics.h"
#include "model.h"
#include "rng.h"
#include "schedule.h"
#include "trainer.h"

typedef struct {
    int B, epochs, max_time, warmup, log_interval, ckpt_interval, val_images;
    double lr, min_lr;
    Optim optim;
    uint64_t seed;
} Hyper;

static Hyper hyper_from_kconfig(void) {
    Hyper h = {
        .B = CONFIG_VIT_BATCH_SIZE,
        .epochs = CONFIG_VIT_EPOCHS,
        .max_time = CONFIG_VIT_MAX_TIME,
        .warmup = CONFIG_VIT_WARMUP_ITERS,
        .log_interval = CONFIG_VIT_LOG_INTERVAL,
        .ckpt_interval = CONFIG_VIT_CHECKPOINT_INTERVAL,
        .val_images = CONFIG_VIT_VAL_IMAGES,
        .lr = KCONFIG_NUMBER(CONFIG_VIT_LR, 0.0, 10.0),
        .min_lr = KCONFIG_NUMBER(CONFIG_VIT_MIN_LR, 0.0, 10.0),
        .optim = OPTIM_FROM_KCONFIG(CONFIG_VIT_BETA1, CONFIG_VIT_BETA2, CONFIG_VIT_ADAM_EPS, CONFIG_VIT_WEIGHT_DECAY,
                                   CONFIG_VIT_GRAD_CLIP),
        .seed = CONFIG_SEED,
    };
    if (h.min_lr > h.lr)
        FATAL("CONFIG_VIT_MIN_LR=%g is above CONFIG_VIT_LR=%g (hint: the floor must not exceed the peak)", h.min_lr,
              h.lr);
    return h;
}

typedef struct {
    TrainRun run;
    VitData data;
    ViT model;
    Hyper h;
    int steps_per_epoch, max_iters;
    int *perm;            /* this epoch's order of the training images */
    int perm_epoch;
    float *patches;       /* one batch */
    int *labels;
    /* running sums of the current epoch (kept in the state file) */
    double epoch_loss, epoch_correct, epoch_seen;
} Run;

static const char *const TRAIN_SERIES[] = {"train_losses", "train_accuracies", "learning_rates", "timestamps",
                                           "images", "images_per_s", "ms_per_iter", "grad_norms"};
static const char *const VAL_SERIES[] = {"val_losses", "val_accuracies", "val_timestamps", "val_images", "epochs",
                                         "train_epoch_losses", "train_epoch_accuracies"};

/* ------------------------------------------------------------------ evaluation */

/* Loss and accuracy over images idx[0..n) of set; confusion (classes^2) if given. The batches are shared
 * out over the ranks (batch j on rank j % procs) and the sums reduced. */
static double evaluate(Run *r, const ImageSet *set, const int *idx, int n, double *acc, long *confusion) {
    const Hyper *h = &r->h;
    ViT *m = &r->model;
    int K = m->cfg.classes, *pred = xmalloc((size_t)h->B * sizeof(int));
    size_t nc = confusion ? (size_t)K * K : 0;
    double *sum = xcalloc(2 + nc, sizeof(double)); /* loss sum, correct, confusion counts */
    for (int start = dist_rank() * h->B; start < n; start += dist_size() * h->B) {
        int count = n - start < h->B ? n - start : h->B;
        vit_batch(&r->data, set, idx + start, count, m->cfg.P, 0, 0, r->patches, r->labels);
        sum[0] += vit_forward(m, r->patches, r->labels, count, 0, 0) * count;
        sum[1] += vit_correct(m, pred);
        if (confusion)
            for (int k = 0; k < count; k++) sum[2 + (size_t)r->labels[k] * K + pred[k]]++;
    }
    free(pred);
    dist_sum(sum, (int)(2 + nc));
    for (size_t i = 0; i < nc; i++) confusion[i] += (long)sum[2 + i];
    *acc = sum[1] / n;
    double loss = sum[0] / n;
    free(sum);
    return loss;
}

static void eval_and_record(Run *r) {
    TrainRun *t = &r->run;
    double t0 = wall_seconds(), acc;
    double val = evaluate(r, &r->data.train, r->data.val_idx, r->data.nval, &acc, NULL);
    int best = val < t->best_val;
    if (best) {
        t->best_val = val;
        t->best_iter = t->iter;
        run_save_model(t, t->best_path, val);
    }
    t->last_val = val;
    t->last_eval_iter = t->iter;
    t->elapsed += wall_seconds() - t0;
    double epoch = (double)t->iter / r->steps_per_epoch;
    double tl = r->epoch_seen > 0 ? r->epoch_loss / r->epoch_seen : NAN;
    double ta = r->epoch_seen > 0 ? r->epoch_correct / r->epoch_seen : NAN;
    metrics_append(t->metrics, "val_iterations", t->iter);
    metrics_append(t->metrics, "val_losses", val);
    metrics_append(t->metrics, "val_accuracies", acc);
    metrics_append(t->metrics, "val_timestamps", t->elapsed);
    metrics_append(t->metrics, "val_images", t->examples);
    metrics_append(t->metrics, "epochs", epoch);
    metrics_append(t->metrics, "train_epoch_losses", tl);
    metrics_append(t->metrics, "train_epoch_accuracies", ta);
    run_write_metrics(t);
    printf("epoch %6.2f | train loss %.4f acc %.4f | val loss %.4f acc %.4f | best %.4f @ %d%s\n", epoch, tl, ta, val,
           acc, t->best_val, t->best_iter, best ? " (saved)" : "");
    fflush(stdout);
    r->epoch_loss = r->epoch_correct = r->epoch_seen = 0.0;
}

/* A training step read back from the device (run_read_records): into the epoch's running sums. */
static void fold_step(void *ctx, const StepRecord *rec) {
    Run *r = ctx;
    r->epoch_loss += rec->loss * r->h.B;
    r->epoch_correct += rec->correct;
    r->epoch_seen += r->h.B;
}

/* Test accuracy, loss and confusion matrix of the parameters now in the model. */
static double test_and_record(Run *r, const char *prefix, int with_confusion) {
    int n = r->data.test.n, K = r->model.cfg.classes;
    int *all = xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) all[i] = i;
    long *conf = xcalloc((size_t)K * K, sizeof(long));
    double acc, loss = evaluate(r, &r->data.test, all, n, &acc, conf);
    char key[64];
    snprintf(key, sizeof key, "%stest_accuracy", prefix);
    metrics_set_number(r->run.metrics, key, acc);
    snprintf(key, sizeof key, "%stest_loss", prefix);
    metrics_set_number(r->run.metrics, key, loss);
    if (with_confusion) { /* rows: true class, columns: predicted */
        size_t cap = (size_t)K * K * 12 + 64, len = 0;
        char *json = xmalloc(cap);
        len += (size_t)snprintf(json, cap, "[");
        for (int i = 0; i < K; i++) {
            len += (size_t)snprintf(json + len, cap - len, "%s[", i ? "," : "");
            for (int j = 0; j < K; j++)
                len += (size_t)snprintf(json + len, cap - len, "%s%ld", j ? "," : "", conf[(size_t)i * K + j]);
            len += (size_t)snprintf(json + len, cap - len, "]");
        }
        snprintf(json + len, cap - len, "]");
        metrics_set_json(r->run.metrics, "confusion_matrix", json);
        free(json);
    }
    free(conf);
    free(all);
    return acc;
}

/* ------------------------------------------------------------------ training */

/* This epoch's order of the training images: a permutation drawn from (seed, epoch). */
static void epoch_order(Run *r, int epoch) {
    if (r->perm_epoch == epoch) return;
    memcpy(r->perm, r->data.train_idx, (size_t)r->data.ntrain * sizeof(int));
    Rng rng = rng_seeded(r->h.seed ^ 0x5eedull, 1000 + (uint64_t)epoch);
    for (int i = r->data.ntrain - 1; i > 0; i--) {
        int j = (int)rng_below(&rng, (uint64_t)i + 1), tmp = r->perm[i];
        r->perm[i] = r->perm[j];
        r->perm[j] = tmp;
    }
    r->perm_epoch = epoch;
}

static void banner(const Run *r) {
    const ViTConfig *c = &r->model.cfg;
    const Hyper *h = &r->h;
    printf("kvlab vit | step %s | attention %s | %s\n", r->run.step, attn_variant_label(ATTN_VARIANT, ATTN_POS),
           backend_name());
    printf("data: %s, %dx%dx%d, %d classes: %d train, %d validation, %d test images\n", r->data.name, c->img_h,
           c->img_w, c->img_c, c->classes, r->data.ntrain, r->data.nval, r->data.test.n);
    printf("model: patch %d (%d tokens, %s pooling), %d layers, %d heads, %d channels, mlp %d | %zu parameters\n",
           c->P, c->T, c->cls ? "CLS" : "mean", c->L, c->H, c->C, c->mlp, r->model.w.table.count);
    printf("cost: %.2f MFLOP/image (training) | train: %d epochs x %d steps of %d images, lr %.3g -> %.3g, wd %g, "
           "seed %llu, %d threads\n", vit_flops_per_image(c) / 1e6, h->epochs, r->steps_per_epoch, h->B, h->lr,
           h->min_lr, h->optim.weight_decay, (unsigned long long)h->seed, backend_threads());
    fflush(stdout);
    run_banner_dist(&r->run);
}

static int train(Run *r) {
    const Hyper *h = &r->h;
    TrainRun *t = &r->run;
    ViT *m = &r->model;
    double interval_t = 0.0, interval_images = 0.0;
    int interval_n = 0;
    const char *stopped_by = "epochs";
    run_catch_signals();
    while (t->iter < r->max_iters) {
        if (h->max_time > 0 && t->train_seconds >= h->max_time) {
            stopped_by = "max_time";
            break;
        }
        double t0 = wall_seconds();
        run_step_begin(t);
        int epoch = t->iter / r->steps_per_epoch, pos = t->iter % r->steps_per_epoch;
        epoch_order(r, epoch);
        DistRange rows = run_batch_rows(t, h->B); /* this rank's images of the global batch */
        vit_batch(&r->data, &r->data.train, r->perm + (size_t)pos * h->B + rows.lo, (int)rows.n, m->cfg.P,
                  r->data.augment, dropout_seed(h->seed, (uint64_t)epoch, 77), r->patches, r->labels);
        double lr = lr_warmup_cosine(t->iter, h->warmup, r->max_iters, h->lr, h->min_lr);
        params_zero_grad(&m->w);
        if (rows.n)
            vit_forward_pass(m, r->patches, r->labels, (int)rows.n, 1, dropout_seed(h->seed, (uint64_t)t->iter, 0));
        double counted = rows.n ? m->counted : 0;
        RunShare share = run_loss_share(t, counted, 1.0);
        if (counted > 0) {
            vit_loss_into(m, &run_record(t)->loss, share.loss_factor);
            vit_correct_into(m, &run_record(t)->correct);
        }
        run_before_backward(t, 1);
        if (counted > 0) vit_backward(m, share.backward_scale);
        run_optim_step(t, &h->optim, lr, t->iter + 1);
        /* the records come back where the host needs them: the steps that log, end an epoch or save, and the last */
        int it = t->iter + 1, logs = it % h->log_interval == 0 || it == 1;
        if ((logs || it % r->steps_per_epoch == 0 || it % h->ckpt_interval == 0 || it == r->max_iters) &&
            run_read_records(t))
            return 1;
        double dt = run_step_done(t, t0, h->B);
        interval_t += dt;
        interval_images += h->B;
        interval_n++;
        if (logs) {
            const StepRecord *rec = &t->recs[t->nrecs - 1]; /* this step's, read above */
            double loss = rec->loss, norm = rec->norm;
            int correct = (int)rec->correct;
            double ms = 1e3 * interval_t / interval_n, ips = interval_images / interval_t;
            metrics_append(t->metrics, "iterations", t->iter);
            metrics_append(t->metrics, "train_losses", loss);
            metrics_append(t->metrics, "train_accuracies", (double)correct / h->B);
            metrics_append(t->metrics, "learning_rates", lr);
            metrics_append(t->metrics, "timestamps", t->elapsed);
            metrics_append(t->metrics, "images", t->examples);
            metrics_append(t->metrics, "images_per_s", ips);
            metrics_append(t->metrics, "ms_per_iter", ms);
            metrics_append(t->metrics, "grad_norms", norm);
            run_write_metrics(t);
            double left = (r->max_iters - t->iter) * ms / 1e3;
            if (h->max_time > 0 && h->max_time - t->train_seconds < left) left = h->max_time - t->train_seconds;
            char eta[32];
            format_eta(eta, sizeof eta, left);
            printf("step %6d/%d | epoch %2d | loss %.4f | acc %.3f | lr %.2e | %6.1f ms/step | %6.0f img/s%s | ETA %s\n",
                   t->iter, r->max_iters, epoch + 1, loss, (double)correct / h->B, lr, ms, ips, run_gpu_memory_note(),
                   eta);
            fflush(stdout);
            interval_t = interval_images = 0.0;
            interval_n = 0;
        }
        int epoch_end = t->iter % r->steps_per_epoch == 0;
        if (epoch_end && t->iter < r->max_iters) eval_and_record(r);
        int stop = run_checkpoint_or_stop(t, (epoch_end || t->iter % h->ckpt_interval == 0) && t->iter < r->max_iters);
        if (stop) return stop;
    }
    if (run_read_last(t)) return 1; /* a time budget ends the loop on any step */
    if (t->last_eval_iter != t->iter || t->best_iter < 0) eval_and_record(r);
    run_save_model(t, t->final_path, t->last_val);
    /* test: the final model (with its confusion matrix), then the best-validation one */
    double final_acc = test_and_record(r, "", 1);
    metrics_set_string(t->metrics, "test_rule", "test_accuracy: final model; best_model_test_accuracy: "
                                                "the checkpoint with the lowest validation loss");
    run_load_params(t, t->best_path);
    double best_acc = test_and_record(r, "best_model_", 0);
    run_finish(t, stopped_by);
    printf("test: final model accuracy %.4f, best-validation model (iteration %d) %.4f\n", final_acc, t->best_iter,
           best_acc);
    printf("done: %d iterations (%s), %.0f images in %.1f s (%.0f img/s) -> %s\n", t->iter, stopped_by, t->examples,
           t->train_seconds, t->examples / (t->train_seconds > 0 ? t->train_seconds : 1), t->final_path);
    return 0;
}

/* ------------------------------------------------------------------ commands */

static void usage(void) {
    fprintf(stderr,
            "usage: train_vit train --out DIR --step NAME [--set NAME=VALUE]...\n"
            "       train_vit eval --ckpt FILE\n"
            "       train_vit info\n");
    exit(2);
}

static void setup(Run *r) {
    Err e;
    r->h = hyper_from_kconfig();
    backend_init(dist_threads(CONFIG_NUM_THREADS));
    if (vit_data_load(&r->data, CONFIG_DATA_DIR, r->h.val_images, r->h.seed, &e) != 0) run_die(&e);
    ImageSet *tr = &r->data.train;
    ViTConfig cfg = vit_config_from_kconfig(tr->h, tr->w, tr->c, tr->classes);
    vit_init(&r->model, &cfg, r->h.seed);
    r->steps_per_epoch = r->data.ntrain / r->h.B;
    if (r->steps_per_epoch < 1)
        FATAL("CONFIG_VIT_BATCH_SIZE=%d is larger than the %d training images", r->h.B, r->data.ntrain);
    r->max_iters = r->h.epochs * r->steps_per_epoch;
    r->perm = xmalloc((size_t)r->data.ntrain * sizeof(int));
    r->perm_epoch = -1;
    size_t per = (size_t)cfg.N * cfg.P * cfg.P * cfg.img_c;
    r->patches = xmalloc((size_t)r->h.B * per * sizeof(float));
    r->labels = xmalloc((size_t)r->h.B * sizeof(int));
    TrainRun *t = &r->run;
    t->dataset = r->data.name;
    t->variant = attn_variant_id(ATTN_VARIANT, ATTN_POS);
    t->unit = "images";
    t->loss_hint = "lower CONFIG_VIT_LR or set CONFIG_VIT_GRAD_CLIP";
    t->model_json = vit_config_json(&cfg);
    t->vocab_json = vit_labels_json(&r->data);
    t->w = &r->model.w;
}

static void teardown(Run *r) {
    run_free(&r->run);
    free(r->perm);
    free(r->patches);
    free(r->labels);
    vit_free(&r->model);
    vit_data_free(&r->data);
}

static int cmd_train(int argc, char **argv) {
    const char *out, *step;
    if (!run_train_args(argc, argv, &out, &step)) usage();
    dist_init(); /* a rank of a job when started by mpirun or srun (Kconfig Distributed) */
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    TrainRun *t = &r.run;
    run_init(t, "vit", out, step, r.h.seed);
    run_track(t, "epoch_loss", &r.epoch_loss);
    run_track(t, "epoch_correct", &r.epoch_correct);
    run_track(t, "epoch_seen", &r.epoch_seen);
    t->on_record = fold_step;
    t->on_record_ctx = &r;
    int resumed = run_try_resume(t, r.max_iters);
    banner(&r);
    run_open_metrics(t, resumed, TRAIN_SERIES, 8, VAL_SERIES, 7);
    const ViTConfig *c = &r.model.cfg;
    metrics_set_string(t->metrics, "variant_label", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    metrics_set_string(t->metrics, "metric", "test_accuracy");
    metrics_set_number(t->metrics, "matmul_parameters", (double)vit_matmul_params(c));
    metrics_set_number(t->metrics, "flops_per_image", vit_flops_per_image(c));
    metrics_set_number(t->metrics, "flops_per_token", vit_flops_per_image(c) / c->T);
    metrics_set_string(t->metrics, "flops_formula",
                       "per image: (6*N_blocks + 12*L*T*C)*T + 6*N_patch*patches + 6*N_head (training)");
    metrics_set_number(t->metrics, "epochs_planned", r.h.epochs);
    metrics_set_number(t->metrics, "steps_per_epoch", r.steps_per_epoch);
    metrics_set_json(t->metrics, "class_names", t->vocab_json);
    run_write_metrics(t);
    int rc = train(&r);
    teardown(&r);
    dist_finalize();
    return rc;
}

static int cmd_eval(int argc, char **argv) {
    const char *ckpt = NULL;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--ckpt") && i + 1 < argc)
            ckpt = argv[++i];
        else
            usage_refuse(argv[i]), usage();
    }
    if (!ckpt) usage();
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    Err e;
    if (checkpoint_load_model(ckpt, "vit", r.run.variant,
                              "use the binary of the step that wrote the checkpoint (output/<run>/train_vit_step<STEP>)",
                              r.run.model_json, "the checkpoint has another model shape or data set", r.run.dataset,
                              r.run.vocab_json, &r.model.w, &e) != 0)
        run_die(&e);
    int n = r.data.test.n, K = r.model.cfg.classes;
    int *all = xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) all[i] = i;
    long *conf = xcalloc((size_t)K * K, sizeof(long));
    double acc, loss = evaluate(&r, &r.data.test, all, n, &acc, conf);
    printf("%s: test accuracy %.4f, loss %.4f on %d images\n", ckpt, acc, loss, n);
    if (K <= 20) {
        printf("confusion (rows: true class, columns: predicted)\n");
        for (int i = 0; i < K; i++) {
            printf("%12.12s", r.data.class_names ? r.data.class_names[i] : "");
            for (int j = 0; j < K; j++) printf(" %5ld", conf[(size_t)i * K + j]);
            printf("\n");
        }
    }
    free(conf);
    free(all);
    teardown(&r);
    return 0;
}

static int cmd_info(void) {
    Run r;
    memset(&r, 0, sizeof r);
    r.run.step = "-";
    setup(&r);
    banner(&r);
    build_info_print();
    teardown(&r);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    if (!strcmp(argv[1], "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(argv[1], "eval")) return cmd_eval(argc - 2, argv + 2);
    if (!strcmp(argv[1], "info")) return cmd_info();
    usage();
    return 2;
}
