/* train_seq2seq: the seq2seq family for the configured task and variant.
 *
 *   train_seq2seq train --out DIR --step NAME    train (resuming from DIR's checkpoint of the step)
 *       [--set NAME=VALUE]...                    with run-time symbols replaced (lib/runconfig.h)
 *   train_seq2seq translate --ckpt FILE [--beam K] [--alpha A] [--n N]
 *                                            translate the first N test sentences
 *   train_seq2seq info
 *
 * Synthetic tasks: every task of CONFIG_SEQ2SEQ_TASKS runs with every seed
 * of CONFIG_SEQ2SEQ_SEEDS, one job after the other; each job generates its
 * data from its seed, trains, validates at every epoch end and reports the
 * per-token test accuracy of its final model. Translation: one job on
 * Multi30k, validation loss and greedy BLEU every epoch, test BLEU with
 * beam search (and greedy) at the end, sample translations in the log. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bleu.h"
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
    int B, epochs, max_time, warmup, log_interval, ckpt_interval;
    double lr;
    Optim optim;
    uint64_t seed;
} Hyper;

static Hyper hyper_from_kconfig(void) {
    Hyper h = {
        .B = CONFIG_SEQ2SEQ_BATCH_SIZE,
        .epochs = CONFIG_SEQ2SEQ_EPOCHS,
        .max_time = CONFIG_SEQ2SEQ_MAX_TIME,
        .warmup = CONFIG_SEQ2SEQ_WARMUP_ITERS,
        .log_interval = CONFIG_SEQ2SEQ_LOG_INTERVAL,
        .ckpt_interval = CONFIG_SEQ2SEQ_CHECKPOINT_INTERVAL,
        .lr = KCONFIG_NUMBER(CONFIG_SEQ2SEQ_LR, 0.0, 100.0),
        .optim = OPTIM_FROM_KCONFIG(CONFIG_SEQ2SEQ_BETA1, CONFIG_SEQ2SEQ_BETA2, CONFIG_SEQ2SEQ_ADAM_EPS, CONFIG_SEQ2SEQ_WEIGHT_DECAY,
                                   CONFIG_SEQ2SEQ_GRAD_CLIP),
        .seed = CONFIG_SEED,
    };
    return h;
}

_Static_assert(IS_ENABLED(CONFIG_SEQ2SEQ_SCHED_NOAM) + IS_ENABLED(CONFIG_SEQ2SEQ_SCHED_COSINE) == 1,
               "the seq2seq schedule is a Kconfig choice");

static double learning_rate(const Hyper *h, int local, int total, int C) {
    if (IS_ENABLED(CONFIG_SEQ2SEQ_SCHED_NOAM)) return lr_noam(local + 1, C, h->warmup, h->lr);
    return lr_cosine_ref(local, h->warmup, total, h->lr);
}

/* The job list of the synthetic tasks: (task, seed) pairs. */
typedef struct {
    int task;
    uint64_t seed;
} Job;

typedef struct {
    TrainRun run;
    S2S model;
    S2SConfig cfg;
    Hyper h;
    Job jobs[64];
    int njobs, iters_per_job, steps_per_epoch;
    SynthData sd;
    int sd_job;       /* job whose data sd holds */
    TransData td;
    int *order, *starts, nbatches, order_epoch;
    int *src, *tgt_in, *tgt_out;
    int *perm;        /* synthetic: training order of the current epoch */
    long perm_key;    /* job * 1e6 + epoch of perm */
    double epoch_loss, epoch_correct, epoch_count; /* running sums of the epoch (state file) */
} Run;

static const char *const TRAIN_SERIES[] = {"train_losses", "train_accuracies", "learning_rates", "timestamps",
                                           "tokens", "tokens_per_s", "ms_per_iter", "grad_norms", "jobs"};
static const char *const VAL_SERIES[] = {"val_losses", "val_accuracies", "val_timestamps", "val_tokens",
                                         "val_bleus", "val_jobs", "train_epoch_losses", "train_epoch_accuracies",
                                         "test_bleus"};

/* ------------------------------------------------------------------ configuration */

static int parse_jobs(Run *r) {
    char *tasks = xstrdup(TRANSLATION ? "translation" : CONFIG_SEQ2SEQ_TASKS), *save = NULL;
    r->njobs = 0;
    if (TRANSLATION) {
        r->jobs[r->njobs++] = (Job){-1, r->h.seed};
        free(tasks);
        return 0;
    }
    for (char *t = strtok_r(tasks, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
        int task = task_from_name(t);
        if (task < 0)
            FATAL("CONFIG_SEQ2SEQ_TASKS: unknown task '%s' (hint: reverse, sort, swap, sub and copy)", t);
        for (int j = 0; j < r->njobs; j++)
            if (r->jobs[j].task == task)
                FATAL("CONFIG_SEQ2SEQ_TASKS: task '%s' is listed twice (hint: list each task once)", t);
        char *seeds = xstrdup(CONFIG_SEQ2SEQ_SEEDS), *save2 = NULL;
        for (char *s = strtok_r(seeds, ", ", &save2); s; s = strtok_r(NULL, ", ", &save2)) {
            char *end;
            errno = 0;
            /* strtoull takes "-1" as 2^64 - 1, and an overflow as ULLONG_MAX: two seeds would be one */
            unsigned long long v = *s >= '0' && *s <= '9' ? strtoull(s, &end, 10) : 0;
            if (!(*s >= '0' && *s <= '9') || *end || errno == ERANGE)
                FATAL("CONFIG_SEQ2SEQ_SEEDS: '%s' is not a seed, a whole number from 0 to 2^64 - 1 (hint: write seeds "
                      "like 1,2)", s);
            for (int j = 0; j < r->njobs; j++)
                if (r->jobs[j].task == task && r->jobs[j].seed == v)
                    FATAL("CONFIG_SEQ2SEQ_SEEDS: seed %llu is listed twice for task '%s' (hint: the mean and "
                          "deviation over seeds would count one run twice; list each seed once)", v, t);
            if (r->njobs == 64)
                FATAL("CONFIG_SEQ2SEQ_TASKS x CONFIG_SEQ2SEQ_SEEDS: more than 64 jobs (hint: fewer tasks or seeds; "
                      "a sweep runs more as separate runs)");
            r->jobs[r->njobs++] = (Job){task, v};
        }
        free(seeds);
    }
    free(tasks);
    if (r->njobs == 0) FATAL("CONFIG_SEQ2SEQ_TASKS or CONFIG_SEQ2SEQ_SEEDS is empty");
    return 0;
}

/* ------------------------------------------------------------------ synthetic */

static void job_data(Run *r, int job) {
    if (r->sd_job == job) return;
    synth_free(&r->sd);
    synth_load(&r->sd, (SynthTask)r->jobs[job].task, CONFIG_SEQ2SEQ_SEQ_LEN, CONFIG_SEQ2SEQ_TRAIN_SEQS, CONFIG_SEQ2SEQ_VAL_SEQS, CONFIG_SEQ2SEQ_TEST_SEQS,
               r->jobs[job].seed);
    r->sd_job = job;
}

/* Loss and per-token accuracy over n sequences (no dropout); batch j on rank j % procs, sums reduced. */
static double synth_eval(Run *r, const int *x, const int *y, int n, double *acc) {
    int B = r->h.B, T = r->sd.T;
    double sum[3] = {0.0, 0.0, 0.0}; /* loss sum, counted, correct */
    int *tin = xmalloc((size_t)B * (T + 1) * sizeof(int)), *tout = xmalloc((size_t)B * (T + 1) * sizeof(int));
    for (int s = dist_rank() * B; s < n; s += dist_size() * B) {
        int b = n - s < B ? n - s : B;
        const int *xs = x + (size_t)s * T, *ys = y + (size_t)s * T;
        double l;
        if (r->cfg.decoder) { /* teacher-forced: <bos>=10, y */
            for (int i = 0; i < b; i++)
                for (int t = 0; t < T; t++) {
                    tin[(size_t)i * T + t] = t == 0 ? SYNTH_BOS : ys[(size_t)i * T + t - 1];
                    tout[(size_t)i * T + t] = ys[(size_t)i * T + t];
                }
            l = s2s_forward(&r->model, xs, T, tin, tout, T, b, 0, 0);
        } else {
            l = s2s_forward(&r->model, xs, T, NULL, ys, T, b, 0, 0);
        }
        sum[0] += l * r->model.counted;
        sum[1] += r->model.counted;
        sum[2] += s2s_correct(&r->model);
    }
    free(tin);
    free(tout);
    dist_sum(sum, 3);
    *acc = sum[1] > 0 ? sum[2] / sum[1] : 0.0;
    return sum[1] > 0 ? sum[0] / sum[1] : NAN;
}

/* ------------------------------------------------------------------ translation */

/* Beam search's length normalisation: finished hypotheses ranked by log p / length^alpha (CONFIG_SEQ2SEQ_BEAM_ALPHA;
 * translate --alpha replaces it). */
static double beam_alpha(void) { return KCONFIG_NUMBER(CONFIG_SEQ2SEQ_BEAM_ALPHA, 0.0, 10.0); }

/* Corpus BLEU of the model's translations of sentences [0, n) of corpus
 * against the raw reference lines; beam 1 = greedy. Hypotheses are
 * detokenised first, so BLEU sees text, as it would from any system.
 * Prints the first `show` translations (those of rank 0's batches: the
 * batches of 50 are shared out over the ranks, the counts reduced). */
static double translate_bleu(Run *r, const Corpus *c, const Strs *ref_lines, int n, int beam, double alpha,
                            int show) {
    const Vocab *tv = &r->td.tgt_vocab, *sv = &r->td.src_vocab;
    int B = 50, maxl = CONFIG_SEQ2SEQ_MAX_LEN;
    BleuStats st = {0};
    int *idx = xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) idx[i] = i;
    int longest = 1;
    for (int i = 0; i < n; i++) longest = c->src_len[i] > longest ? c->src_len[i] : longest;
    size_t cap = (size_t)B * (longest + maxl + 2);
    int *src = xmalloc(cap * sizeof(int)), *out = xmalloc((size_t)B * maxl * sizeof(int));
    int *lens = xmalloc((size_t)B * sizeof(int)), *tin = xmalloc(cap * sizeof(int)), *tout = xmalloc(cap * sizeof(int));
    for (int s = dist_rank() * B; s < n; s += dist_size() * B) {
        int b = n - s < B ? n - s : B, S, T;
        trans_batch(c, idx + s, b, src, tin, tout, &S, &T);
        int limit = S + 20 < maxl ? S + 20 : maxl;
        s2s_decode(&r->model, src, S, b, beam, alpha, limit, TOK_BOS, TOK_EOS, out, lens);
        for (int i = 0; i < b; i++) {
            Strs words = {0};
            ids_to_words(tv, out + (size_t)i * limit, lens[i], &words);
            char *hyp = detokenize(&words);
            bleu_add_text(&st, hyp, ref_lines->s[s + i]);
            if (s + i < show) {
                Strs sw = {0};
                ids_to_words(sv, c->src[s + i], c->src_len[s + i], &sw);
                char *src_text = detokenize(&sw);
                printf("  src: %s\n  ref: %s\n  hyp: %s\n", src_text, ref_lines->s[s + i], hyp);
                free(src_text);
                strs_free(&sw);
            }
            free(hyp);
            strs_free(&words);
        }
    }
    fflush(stdout);
    free(idx), free(src), free(out), free(lens), free(tin), free(tout);
    double counts[10];
    for (int k = 0; k < 4; k++) counts[k] = (double)st.match[k], counts[4 + k] = (double)st.total[k];
    counts[8] = (double)st.hyp_len, counts[9] = (double)st.ref_len;
    dist_sum(counts, 10);
    for (int k = 0; k < 4; k++) st.match[k] = (long)counts[k], st.total[k] = (long)counts[4 + k];
    st.hyp_len = (long)counts[8], st.ref_len = (long)counts[9];
    return bleu_score(&st);
}

static double trans_eval(Run *r, const Corpus *c, double *acc) {
    int B = r->h.B;
    double sum[3] = {0.0, 0.0, 0.0}; /* loss sum, counted, correct */
    int *idx = xmalloc((size_t)c->n * sizeof(int));
    for (int i = 0; i < c->n; i++) idx[i] = i;
    for (int s = dist_rank() * B; s < c->n; s += dist_size() * B) {
        int b = c->n - s < B ? c->n - s : B, S, T;
        trans_batch(c, idx + s, b, r->src, r->tgt_in, r->tgt_out, &S, &T);
        double l = s2s_forward(&r->model, r->src, S, r->tgt_in, r->tgt_out, T, b, 0, 0);
        sum[0] += l * r->model.counted;
        sum[1] += r->model.counted;
        sum[2] += s2s_correct(&r->model);
    }
    free(idx);
    dist_sum(sum, 3);
    *acc = sum[1] > 0 ? sum[2] / sum[1] : 0.0;
    return sum[1] > 0 ? sum[0] / sum[1] : NAN;
}

/* ------------------------------------------------------------------ training */

static void banner(const Run *r) {
    const S2SConfig *c = &r->cfg;
    printf("kvlab seq2seq | step %s | attention %s (cross-attention QKV) | %s\n", r->run.step,
           attn_variant_label(ATTN_VARIANT, ATTN_POS), backend_name());
    if (TRANSLATION)
        printf("data: multi30k %s->%s: %d training pairs (%d longer than %d tokens dropped), vocab %d / %d\n",
               r->td.src_lang, r->td.tgt_lang, r->td.train.n, r->td.dropped, CONFIG_SEQ2SEQ_MAX_LEN,
               r->td.src_vocab.words.n, r->td.tgt_vocab.words.n);
    else
        printf("data: %d synthetic jobs (tasks x seeds), %d train / %d val / %d test sequences of %d digits each\n",
               r->njobs, CONFIG_SEQ2SEQ_TRAIN_SEQS, CONFIG_SEQ2SEQ_VAL_SEQS, CONFIG_SEQ2SEQ_TEST_SEQS, CONFIG_SEQ2SEQ_SEQ_LEN);
    printf("model: %s, %d channels, %d heads, %d+%d layers, mlp %d, %s-LN | %zu parameters\n",
           c->decoder ? "encoder-decoder" : "encoder only", c->C, c->H, c->L_enc, c->decoder ? c->L_dec : 0, c->mlp,
           c->post_ln ? "post" : "pre", r->model.w.table.count);
    printf("train: %d epochs x %d steps of %d sequences%s, seed %llu, %d threads\n", r->h.epochs, r->steps_per_epoch,
           r->h.B, r->njobs > 1 ? " per job" : "", (unsigned long long)r->h.seed, backend_threads());
    fflush(stdout);
    run_banner_dist(&r->run);
}

/* A fresh model for a job (its own seed), moments zero. */
static void start_job(Run *r, int job) {
    S2S *m = &r->model;
    S2S fresh;
    s2s_init(&fresh, &r->cfg, r->jobs[job].seed);
    dev_copy(m->w.params, fresh.w.params, m->w.table.total * sizeof(float));
    s2s_free(&fresh);
    run_reset_optimizer(&r->run);
    r->run.best_val = INFINITY;
    r->run.best_iter = -1;
}

static void end_of_epoch(Run *r, int job) {
    TrainRun *t = &r->run;
    double t0 = wall_seconds(), acc, val, bleu = NAN, test_bleu = NAN;
    if (TRANSLATION) {
        val = trans_eval(r, &r->td.val, &acc);
        bleu = translate_bleu(r, &r->td.val, &r->td.val_lines, r->td.val.n, 1, beam_alpha(), 0);
        if (IS_ENABLED(CONFIG_SEQ2SEQ_TEST_BLEU_EPOCHS)) /* the paper's Figure 6: test BLEU per epoch */
            test_bleu = translate_bleu(r, &r->td.test, &r->td.test_lines, r->td.test.n, 1, beam_alpha(), 0);
        if (val < t->best_val) {
            t->best_val = val;
            t->best_iter = t->iter;
            run_save_model(t, t->best_path, val);
        }
    } else {
        val = synth_eval(r, r->sd.val_x, r->sd.val_y, r->sd.nval, &acc);
        if (val < t->best_val) t->best_val = val, t->best_iter = t->iter;
    }
    t->last_val = val;
    t->last_eval_iter = t->iter;
    t->elapsed += wall_seconds() - t0;
    double tl = r->epoch_count > 0 ? r->epoch_loss / r->epoch_count : NAN;
    double ta = r->epoch_count > 0 ? r->epoch_correct / r->epoch_count : NAN;
    metrics_append(t->metrics, "val_iterations", t->iter);
    metrics_append(t->metrics, "val_losses", val);
    metrics_append(t->metrics, "val_accuracies", acc);
    metrics_append(t->metrics, "val_timestamps", t->elapsed);
    metrics_append(t->metrics, "val_tokens", t->examples);
    metrics_append(t->metrics, "val_bleus", bleu);
    metrics_append(t->metrics, "val_jobs", job);
    metrics_append(t->metrics, "train_epoch_losses", tl);
    metrics_append(t->metrics, "train_epoch_accuracies", ta);
    metrics_append(t->metrics, "test_bleus", test_bleu);
    run_write_metrics(t);
    if (TRANSLATION && IS_ENABLED(CONFIG_SEQ2SEQ_TEST_BLEU_EPOCHS))
        printf("epoch %3d | train loss %.4f acc %.4f | val loss %.4f acc %.4f BLEU %.2f | test BLEU %.2f (greedy)\n",
               (t->iter - 1) / r->steps_per_epoch + 1, tl, ta, val, acc, bleu, test_bleu);
    else if (TRANSLATION)
        printf("epoch %3d | train loss %.4f acc %.4f | val loss %.4f acc %.4f BLEU %.2f (greedy)\n",
               (t->iter - 1) / r->steps_per_epoch + 1, tl, ta, val, acc, bleu);
    else
        printf("%-7s seed %llu epoch %2d | train loss %.4f acc %.4f | val loss %.4f acc %.4f\n",
               task_name((SynthTask)r->jobs[job].task), (unsigned long long)r->jobs[job].seed,
               ((t->iter - 1) % r->iters_per_job) / r->steps_per_epoch + 1, tl, ta, val, acc);
    fflush(stdout);
    r->epoch_loss = r->epoch_correct = r->epoch_count = 0.0;
}

/* A training step read back from the device (run_read_records): into the epoch's running sums. */
static void fold_step(void *ctx, const StepRecord *rec) {
    Run *r = ctx;
    r->epoch_loss += rec->loss * rec->counted;
    r->epoch_correct += rec->correct;
    r->epoch_count += rec->counted;
}

/* Records a finished synthetic job: its final model's test accuracy. */
static void end_of_job(Run *r, int job) {
    TrainRun *t = &r->run;
    double acc, loss = synth_eval(r, r->sd.test_x, r->sd.test_y, r->sd.ntest, &acc);
    char key[128], path[4096];
    snprintf(key, sizeof key, "job_%s_seed%llu_test_accuracy", task_name((SynthTask)r->jobs[job].task),
             (unsigned long long)r->jobs[job].seed);
    metrics_set_number(t->metrics, key, acc);
    snprintf(key, sizeof key, "job_%s_seed%llu_test_loss", task_name((SynthTask)r->jobs[job].task),
             (unsigned long long)r->jobs[job].seed);
    metrics_set_number(t->metrics, key, loss);
    snprintf(path, sizeof path, "%s/final_model_step%s-%s-seed%llu.safetensors", t->out, t->step,
             task_name((SynthTask)r->jobs[job].task), (unsigned long long)r->jobs[job].seed);
    run_save_model(t, path, t->last_val);
    run_write_metrics(t);
    printf("%-7s seed %llu: test token accuracy %.4f (loss %.4f) -> %s\n", task_name((SynthTask)r->jobs[job].task),
           (unsigned long long)r->jobs[job].seed, acc, loss, path);
    fflush(stdout);
}

/* Per-task means over the seeds and the overall mean, from the metrics. */
static void synth_summary(Run *r) {
    double total = 0.0;
    int ntasks = 0;
    char json[4096];
    size_t len = (size_t)snprintf(json, sizeof json, "{");
    for (int task = 0; task < NUM_TASKS; task++) {
        double sum = 0.0;
        int n = 0;
        for (int j = 0; j < r->njobs; j++) {
            if (r->jobs[j].task != task) continue;
            char key[128];
            snprintf(key, sizeof key, "job_%s_seed%llu_test_accuracy", task_name((SynthTask)task),
                     (unsigned long long)r->jobs[j].seed);
            sum += metrics_get_number(r->run.metrics, key);
            n++;
        }
        if (!n) continue;
        len += (size_t)snprintf(json + len, sizeof json - len, "%s\"%s\":%.6f", ntasks ? "," : "",
                                task_name((SynthTask)task), sum / n);
        total += sum / n;
        ntasks++;
        printf("task %-7s: mean test token accuracy %.4f over %d seed(s)\n", task_name((SynthTask)task), sum / n, n);
    }
    snprintf(json + len, sizeof json - len, "}");
    metrics_set_json(r->run.metrics, "synthetic_test_accuracy", json);
    metrics_set_number(r->run.metrics, "test_accuracy", ntasks ? total / ntasks : NAN);
}

static int train(Run *r) {
    const Hyper *h = &r->h;
    TrainRun *t = &r->run;
    S2S *m = &r->model;
    int total = r->njobs * r->iters_per_job;
    double interval_t = 0.0, interval_tok = 0.0;
    int interval_n = 0;
    const char *stopped_by = "epochs";
    double job_start_seconds = 0.0;
    run_catch_signals();
    while (t->iter < total) {
        int job = t->iter / r->iters_per_job, local = t->iter % r->iters_per_job;
        int epoch = local / r->steps_per_epoch, pos = local % r->steps_per_epoch;
        if (local == 0) {
            start_job(r, job);
            job_start_seconds = t->train_seconds;
        }
        if (h->max_time > 0 && t->train_seconds - job_start_seconds >= h->max_time) { /* skip the job's rest */
            stopped_by = "max_time";
            t->skipped_iters += (job + 1) * r->iters_per_job - t->iter;
            t->iter = (job + 1) * r->iters_per_job;
            if (run_read_last(t)) return 1; /* the job's steps so far, into its epoch's sums */
            if (!TRANSLATION) {
                end_of_epoch(r, job);
                end_of_job(r, job);
            }
            continue;
        }
        double t0 = wall_seconds();
        run_step_begin(t);
        int B, S, T;
        DistRange rows; /* this rank's rows of the global batch */
        if (TRANSLATION) {
            if (r->order_epoch != epoch) {
                r->nbatches = trans_epoch_batches(&r->td, h->B, h->seed, epoch, r->order, r->starts);
                r->order_epoch = epoch;
            }
            B = r->starts[pos + 1] - r->starts[pos];
            rows = run_batch_rows(t, B);
            const int *batch = r->order + r->starts[pos];
            trans_batch_lengths(&r->td.train, batch, B, &S, &T); /* the whole batch's padding, on every rank */
            trans_batch_fill(&r->td.train, batch + rows.lo, (int)rows.n, S, T, r->src, r->tgt_in, r->tgt_out);
        } else {
            job_data(r, job);
            B = h->B, S = T = r->sd.T;
            if (r->perm_key != (long)job * 1000000 + epoch) { /* this epoch's shuffle, from (job seed, epoch) */
                Rng rng = rng_seeded(r->jobs[job].seed, 3000 + (uint64_t)epoch);
                for (int i = 0; i < r->sd.ntrain; i++) r->perm[i] = i;
                for (int i = r->sd.ntrain - 1; i > 0; i--) {
                    int j = (int)(rng_u64(&rng) % (uint64_t)(i + 1)), tmp = r->perm[i];
                    r->perm[i] = r->perm[j];
                    r->perm[j] = tmp;
                }
                r->perm_key = (long)job * 1000000 + epoch;
            }
            rows = run_batch_rows(t, B);
            for (int b = 0; b < (int)rows.n; b++) { /* batch pos of the permutation; the last partial batch is dropped */
                size_t i = (size_t)r->perm[(size_t)pos * B + rows.lo + b];
                memcpy(r->src + (size_t)b * S, r->sd.train_x + i * S, (size_t)S * sizeof(int));
                memcpy(r->tgt_out + (size_t)b * S, r->sd.train_y + i * S, (size_t)S * sizeof(int));
                for (int j = 0; j < S; j++) /* decoder input: <bos> = 10, then the labels shifted right */
                    r->tgt_in[(size_t)b * S + j] = j == 0 ? SYNTH_BOS : r->sd.train_y[i * S + j - 1];
            }
        }
        double lr = learning_rate(h, local, r->iters_per_job, r->cfg.C);
        params_zero_grad(&m->w);
        if (rows.n)
            s2s_forward_pass(m, r->src, S, r->tgt_in, r->tgt_out, T, (int)rows.n, 1,
                             dropout_seed(h->seed, (uint64_t)t->iter, 0));
        double local_counted = rows.n ? m->counted : 0;
        RunShare share = run_loss_share(t, local_counted, 1.0);
        double counted = share.counted;
        if (local_counted > 0) {
            s2s_loss_into(m, &run_record(t)->loss, share.loss_factor);
            s2s_correct_into(m, &run_record(t)->correct);
        }
        run_before_backward(t, 1);
        if (local_counted > 0) s2s_backward(m, share.backward_scale);
        run_optim_step(t, &h->optim, lr, local + 1); /* each job starts its optimiser afresh */
        /* the records come back where the host needs them: the steps that log, end an epoch or save */
        int it = t->iter + 1, logs = it % h->log_interval == 0 || local == 0;
        int epoch_end = (local + 1) % r->steps_per_epoch == 0, job_end = local + 1 == r->iters_per_job;
        if ((logs || epoch_end || it % h->ckpt_interval == 0 || it == total) && run_read_records(t)) return 1;
        double dt = run_step_done(t, t0, counted);
        interval_t += dt;
        interval_tok += counted;
        interval_n++;
        if (logs) {
            const StepRecord *rec = &t->recs[t->nrecs - 1]; /* this step's, read above */
            double loss = rec->loss, correct = rec->correct, norm = rec->norm;
            double ms = 1e3 * interval_t / interval_n, tps = interval_tok / interval_t;
            metrics_append(t->metrics, "iterations", t->iter);
            metrics_append(t->metrics, "train_losses", loss);
            metrics_append(t->metrics, "train_accuracies", (double)correct / (counted ? counted : 1));
            metrics_append(t->metrics, "learning_rates", lr);
            metrics_append(t->metrics, "timestamps", t->elapsed);
            metrics_append(t->metrics, "tokens", t->examples);
            metrics_append(t->metrics, "tokens_per_s", tps);
            metrics_append(t->metrics, "ms_per_iter", ms);
            metrics_append(t->metrics, "grad_norms", norm);
            metrics_append(t->metrics, "jobs", job);
            run_write_metrics(t);
            char eta[32];
            format_eta(eta, sizeof eta, (total - t->iter) * ms / 1e3);
            printf("step %7d/%d | %s | loss %.4f | acc %.3f | lr %.2e | %6.1f ms/step | %7.0f tok/s%s | ETA %s\n",
                   t->iter, total, TRANSLATION ? "translate" : task_name((SynthTask)r->jobs[job].task), loss,
                   (double)correct / (counted ? counted : 1), lr, ms, tps, run_gpu_memory_note(), eta);
            fflush(stdout);
            interval_t = interval_tok = 0.0;
            interval_n = 0;
        }
        if (epoch_end) end_of_epoch(r, job);
        if (job_end && !TRANSLATION) end_of_job(r, job);
        int stop = run_checkpoint_or_stop(t, (epoch_end || t->iter % h->ckpt_interval == 0) && t->iter < total);
        if (stop) return stop;
    }
    if (run_read_last(t)) return 1;
    run_save_model(t, t->final_path, t->last_val);
    if (TRANSLATION) {
        int beam = CONFIG_SEQ2SEQ_BEAM;
        printf("test translations (beam %d):\n", beam);
        double bleu = translate_bleu(r, &r->td.test, &r->td.test_lines, r->td.test.n, beam, beam_alpha(), 5);
        double greedy =
            beam == 1 ? bleu : translate_bleu(r, &r->td.test, &r->td.test_lines, r->td.test.n, 1, beam_alpha(), 0);
        double acc, tl = trans_eval(r, &r->td.test, &acc);
        metrics_set_number(t->metrics, "test_bleu", bleu);
        metrics_set_number(t->metrics, "test_bleu_greedy", greedy);
        metrics_set_number(t->metrics, "test_loss", tl);
        metrics_set_number(t->metrics, "test_accuracy", acc);
        metrics_set_string(t->metrics, "test_rule", "final model; BLEU-4 on lowercased, punctuation-split words "
                                                    "without <bos>/<eos>/<pad>");
        printf("test: BLEU %.2f (beam %d), %.2f (greedy); loss %.4f, token accuracy %.4f\n", bleu, beam, greedy, tl,
               acc);
    } else {
        synth_summary(r);
    }
    run_finish(t, stopped_by);
    printf("done: %.0f iterations%s, %.0f tokens in %.1f s (%.0f tok/s) -> %s\n", t->iter - t->skipped_iters,
           t->skipped_iters > 0 ? " (the time budget ended training early)" : "", t->examples, t->train_seconds,
           t->examples / (t->train_seconds > 0 ? t->train_seconds : 1), t->final_path);
    return 0;
}

/* ------------------------------------------------------------------ commands */

static void usage(void) {
    fprintf(stderr,
            "usage: train_seq2seq train --out DIR --step NAME [--set NAME=VALUE]...\n"
            "       train_seq2seq translate --ckpt FILE [--beam K] [--alpha A] [--n N]   (translation models)\n"
            "       train_seq2seq info\n");
    exit(2);
}

static void setup(Run *r) {
    Err e;
    r->h = hyper_from_kconfig();
    backend_init(dist_threads(CONFIG_NUM_THREADS));
    parse_jobs(r);
    r->sd_job = -1;
    r->order_epoch = -1;
    r->perm_key = -1;
    if (TRANSLATION && trans_load(&r->td, CONFIG_DATA_DIR, IS_ENABLED(CONFIG_SEQ2SEQ_DE_EN), CONFIG_SEQ2SEQ_MIN_FREQ, CONFIG_SEQ2SEQ_MAX_LEN, IS_ENABLED(CONFIG_SEQ2SEQ_SHARED_EMB), &e) != 0)
        run_die(&e);
    S2SConfig c = s2s_config_from_kconfig(TRANSLATION ? &r->td : NULL);
    int longest = c.Tmax;
    if (TRANSLATION) {
        r->steps_per_epoch = (r->td.train.n + r->h.B - 1) / r->h.B;
        r->order = xmalloc((size_t)r->td.train.n * sizeof(int));
        r->starts = xmalloc((size_t)(r->steps_per_epoch + 1) * sizeof(int));
    } else {
        r->steps_per_epoch = CONFIG_SEQ2SEQ_TRAIN_SEQS / r->h.B;
        r->perm = xmalloc((size_t)CONFIG_SEQ2SEQ_TRAIN_SEQS * sizeof(int));
        if (r->steps_per_epoch < 1)
            FATAL("CONFIG_SEQ2SEQ_BATCH_SIZE=%d is larger than CONFIG_SEQ2SEQ_TRAIN_SEQS=%d", r->h.B, CONFIG_SEQ2SEQ_TRAIN_SEQS);
    }
    r->cfg = c;
    r->iters_per_job = r->h.epochs * r->steps_per_epoch;
    s2s_init(&r->model, &c, r->h.seed);
    size_t buf = (size_t)r->h.B * (longest + 2);
    r->src = xmalloc(buf * sizeof(int)), r->tgt_in = xmalloc(buf * sizeof(int)), r->tgt_out = xmalloc(buf * sizeof(int));
    TrainRun *t = &r->run;
    t->dataset = TRANSLATION ? (IS_ENABLED(CONFIG_SEQ2SEQ_DE_EN) ? "multi30k-de-en" : "multi30k-en-de") : "synthetic";
    t->variant = attn_variant_id(ATTN_VARIANT, ATTN_POS);
    t->unit = "tokens";
    t->loss_hint = "lower CONFIG_SEQ2SEQ_LR or set CONFIG_SEQ2SEQ_GRAD_CLIP";
    t->model_json = s2s_config_json(&c);
    t->vocab_json = xstrdup(TRANSLATION ? "{\"type\":\"words\",\"note\":\"rebuilt from the training set\"}"
                                        : "{\"type\":\"digits\",\"size\":10}");
    t->w = &r->model.w;
}

static void teardown(Run *r) {
    run_free(&r->run);
    free(r->src), free(r->tgt_in), free(r->tgt_out), free(r->order), free(r->starts), free(r->perm);
    s2s_free(&r->model);
    synth_free(&r->sd);
    if (TRANSLATION) trans_free(&r->td);
}

static int cmd_train(int argc, char **argv) {
    const char *out, *step;
    if (!run_train_args(argc, argv, &out, &step)) usage();
    dist_init(); /* a rank of a job when started by mpirun or srun (Kconfig Distributed) */
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    TrainRun *t = &r.run;
    run_init(t, "seq2seq", out, step, r.h.seed);
    run_track(t, "epoch_loss", &r.epoch_loss);
    run_track(t, "epoch_correct", &r.epoch_correct);
    run_track(t, "epoch_count", &r.epoch_count);
    run_track(t, "skipped_iterations", &t->skipped_iters);
    t->on_record = fold_step;
    t->on_record_ctx = &r;
    int resumed = run_try_resume(t, r.njobs * r.iters_per_job);
    banner(&r);
    run_open_metrics(t, resumed, TRAIN_SERIES, (int)(sizeof TRAIN_SERIES / sizeof *TRAIN_SERIES), VAL_SERIES,
                     (int)(sizeof VAL_SERIES / sizeof *VAL_SERIES));
    const S2SConfig *c = &r.cfg;
    metrics_set_string(t->metrics, "variant_label", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    metrics_set_string(t->metrics, "task", TRANSLATION ? "translation" : "synthetic");
    metrics_set_string(t->metrics, "metric", TRANSLATION ? "test_bleu" : "test_accuracy");
    metrics_set_number(t->metrics, "matmul_parameters", (double)s2s_matmul_params(c));
    metrics_set_number(t->metrics, "flops_per_token", 6.0 * (double)s2s_matmul_params(c));
    metrics_set_string(t->metrics, "flops_formula", "6*N_matmul per token (attention products not counted)");
    metrics_set_number(t->metrics, "steps_per_epoch", r.steps_per_epoch);
    run_write_metrics(t);
    int rc = train(&r);
    teardown(&r);
    dist_finalize();
    return rc;
}

#define TRANSLATE_NUMBER(opt, s, lo, hi, integer) \
    option_number("translate", opt, s, lo, hi, integer, "e.g. --n 10 --beam 4 --alpha 0.6")

static int cmd_translate(int argc, char **argv) {
    const char *ckpt = NULL;
    int beam = TRANSLATION ? CONFIG_SEQ2SEQ_BEAM : 1, n = 10;
    double alpha = TRANSLATION ? beam_alpha() : 0.0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--ckpt") && i + 1 < argc)
            ckpt = argv[++i];
        else if (!strcmp(argv[i], "--beam") && i + 1 < argc)
            beam = (int)TRANSLATE_NUMBER("--beam", argv[++i], 1, 64, 1);
        else if (!strcmp(argv[i], "--alpha") && i + 1 < argc)
            alpha = TRANSLATE_NUMBER("--alpha", argv[++i], 0, 10, 0);
        else if (!strcmp(argv[i], "--n") && i + 1 < argc)
            n = (int)TRANSLATE_NUMBER("--n", argv[++i], 1, 1e9, 1);
        else
            usage_refuse(argv[i]), usage();
    }
    if (!ckpt) usage();
    if (!TRANSLATION) FATAL("translate: this binary is built for the synthetic tasks (hint: use a translation step)");
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    Err e;
    if (checkpoint_load_model(ckpt, "seq2seq", r.run.variant,
                              "use the binary of the step that wrote it (output/<run>/train_seq2seq_step<STEP>)",
                              r.run.model_json, "the checkpoint has another model shape or vocabulary", r.run.dataset,
                              r.run.vocab_json, &r.model.w, &e) != 0)
        run_die(&e);
    if (n > r.td.test.n) n = r.td.test.n;
    double bleu = translate_bleu(&r, &r.td.test, &r.td.test_lines, n, beam, alpha, n);
    printf("BLEU %.2f on the first %d test sentences (beam %d, alpha %g)\n", bleu, n, beam, alpha);
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
    if (!strcmp(argv[1], "translate")) return cmd_translate(argc - 2, argv + 2);
    if (!strcmp(argv[1], "info")) return cmd_info();
    usage();
    return 2;
}
