/* What the trainers of every model family share: the files of a step, the
 * resumable run state, the metrics document, checkpoint metadata, progress
 * formatting and stop signals. A family sets the model-specific fields and
 * calls these around its own training loop.
 *
 * Files of step STEP in the output folder:
 *   final_model_step<STEP>.safetensors   parameters at the end
 *   best_model_step<STEP>.safetensors    parameters at the best validation loss
 *   state_step<STEP>.safetensors         resume point (parameters, AdamW moments, progress)
 *   training_metrics_step<STEP>.json     curves and facts, rewritten as training goes */
#ifndef KVLAB_TRAINER_H
#define KVLAB_TRAINER_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "buildinfo.h"
#include "checkpoint.h"
#include "common.h"
#include "dist.h"
#include "grad_sync.h"
#include "kernels.h"
#include "metrics.h"
#include "rng.h"

/* What a training step computes for the host, kept on the device until the host needs it (run_record). */
typedef struct {
    double loss;    /* the step's mean loss over every rank's counted examples (accumulations averaged) */
    double correct; /* correct predictions over every rank (families that count them) */
    double norm;    /* the global gradient norm before clipping */
    double counted; /* the host's: examples that counted, over every rank (run_loss_share) */
    int iter;       /* the host's: the iteration (1-based) */
} StepRecord;

typedef struct {
    /* set by the family before use */
    const char *family, *step, *out, *dataset, *variant;
    const char *unit;        /* what examples are: "tokens", "images", "sequences" */
    char *model_json;        /* model description, metadata "model" */
    char *vocab_json;        /* vocabulary or label names, metadata "tokenizer" (may be NULL) */
    Params *w;               /* the model's parameters and AdamW moments (device buffers) */
    uint64_t seed;
    /* files */
    char final_path[4096], best_path[4096], state_path[4096], metrics_path[4096];
    Metrics *metrics;
    /* progress; all of it goes into the state file */
    int iter;                /* optimiser steps done, or skipped past (skipped_iters) */
    double skipped_iters;    /* iterations a time budget skipped (a job's rest); family-tracked (run_track) */
    Rng data_rng;            /* data order */
    double train_seconds;    /* time inside training steps (the wall-time budget) */
    double elapsed;          /* wall time of the step, evaluations included, across resumes */
    double examples;         /* units seen (tokens, images, sequences) */
    double best_val, last_val;
    int best_iter, last_eval_iter;
    /* family counters that must survive a resume (e.g. running epoch sums) */
    struct {
        const char *name;
        double *value;
    } extra[8];
    int nextra;
    struct WandbRun *wandb;  /* experiment tracking (train/tracking.c), NULL when off */
    /* data parallelism (train/dist.h), set by run_init: this process's rank of procs; rank 0 alone writes
     * files. With ZeRO-1 (zero1) w->m and w->v hold only the moments of this rank's slice of the flat
     * parameter buffer, values [zslice.lo, zslice.lo + zslice.n) */
    int rank, procs, zero1;
    DistRange zslice;
    GradSync sync; /* the gradient sum over the ranks, in buckets when DIST_BUCKET_KIB says so */
    /* the op profile of KVLAB_PROFILE_STEPS steps (train/profile.c): steps to profile (0: off), profiled so far,
     * steps this process has run, the first profiled iteration, whether the profile is on */
    int profile_steps, profile_done, steps_here, profile_first, profiling;
    /* step records: the family's hint for a non-finite loss (e.g. "lower CONFIG_GPT2_LR or set
     * CONFIG_GPT2_GRAD_CLIP"); the records on the device, rec_pending of rec_cap unread; recs: the host's copies of
     * the nrecs records the last run_read_records returned */
    const char *loss_hint;
    StepRecord *rec_dev, *recs;
    int rec_cap, rec_pending, nrecs;
    /* called by run_read_records for each good record, oldest first (running sums of an epoch), wherever the
     * read happens (a stop saves the state after it); NULL: none */
    void (*on_record)(void *ctx, const StepRecord *rec);
    void *on_record_ctx;
} TrainRun;

/* Frees what the run holds (the step records on the device and host, the metrics document, model_json,
 * vocab_json, the gradient-sum plan); the family frees its model and data. */
void run_free(TrainRun *r);

/* Saves *value in the state file under name and restores it on resume. */
void run_track(TrainRun *r, const char *name, double *value);

/* The train command's arguments, the same in every family: --out DIR and --step NAME (both required), and any
 * number of --set NAME=VALUE (a run-time symbol's value for this run, applied here: lib/runconfig.h). Returns 0
 * where an argument is unknown, lacks its value, or --out or --step is missing, after one line naming it: the caller
 * prints its usage. */
int run_train_args(int argc, char **argv, const char **out, const char **step);

/* Sets the file names in out (created if needed, by rank 0) and the initial progress; r->w must be set. With
 * several processes (dist_init before) it also sets up ZeRO-1 when configured. */
void run_init(TrainRun *r, const char *family, const char *out, const char *step, uint64_t seed);
/* Stops the program with the error (one line, exit status 1; in a job of several processes the line names
 * the rank and host and the whole job stops); metrics still "running" are marked "failed" with the error
 * first. */
void run_die(const Err *e) KV_NORETURN;

/* Files are written by rank 0 only; every rank calls these together (the state gathers ZeRO-1 moments). */
void run_save_model(TrainRun *r, const char *path, double val_loss);
void run_save_state(TrainRun *r);
/* Restores parameters, moments and progress from the state file when it
 * exists and was written by this very configuration (the Distributed menu
 * aside: a state resumes with any number of processes); returns 1 if it
 * did. Rank 0 reads the file and sends it to the other ranks. Each progress
 * value must be one the trainer can have written (the step within
 * [0, max_iters], counts and times not negative, ...): the run stops with
 * one line naming the field otherwise. Without a state file, a final model
 * in the folder (the step finished there) stops the run too: a fresh run
 * would write over it. */
int run_try_resume(TrainRun *r, int max_iters);
/* Loads the parameters of a model checkpoint of this family (rank 0 reads, every rank gets them). */
void run_load_params(TrainRun *r, const char *path);

/* Opens the metrics file (continuing it after a resume, without the entries
 * past the resumed iteration) and writes the facts every family records. */
void run_open_metrics(TrainRun *r, int resumed, const char *const *train_series, int ntrain,
                      const char *const *val_series, int nval);
/* Updates the running totals (iterations, best validation, speed, memory) and writes the file. */
void run_write_metrics(TrainRun *r);
/* " | GPU <peak>/<capacity> MiB" for the progress lines on a GPU backend (peak of live device buffers), "" on
 * the CPU. */
const char *run_gpu_memory_note(void);
/* Marks the metrics complete, writes them and removes the state file. */
void run_finish(TrainRun *r, const char *stopped_by);
void run_fail(TrainRun *r, const char *status, const char *msg);

/* SIGINT, SIGTERM and SIGHUP set a flag the loop checks after each step
 * (save, then stop); so does SIGUSR1, the stop request scripts/run_steps.py
 * sends through mpirun (which forwards it, where it would follow SIGTERM
 * with SIGKILL within a second). SIGPIPE is ignored, and a failed write to
 * stdout or stderr (the step runner is gone) counts as a stop request too. */
void run_catch_signals(void);
/* The stop request: the signal number (SIGPIPE for lost output), or 0. */
int run_stop_signal(void);
/* Saves the state at the current iteration, marks the metrics "stopped",
 * prints one line and returns the exit status (128 + signal). */
int run_stop(TrainRun *r);

/* ------------------------------------------------------------------ data parallelism
 *
 * Every rank draws the same global batch (the same data order from the seed) and trains on its own rows
 * of it; the loss is normalised by the global count and the gradients summed over the ranks once per
 * optimizer step, so nothing depends on the number of processes:
 *
 *     DistRange rows = run_batch_rows(t, B);          this rank's rows of the B of the global batch
 *     local forward on rows.n rows (if any) ...
 *     RunShare s = run_loss_share(t, local_counted, scale);
 *     the family's *_loss_into(model, &run_record(t)->loss, s.loss_factor)   (if local_counted)
 *     backward (if local_counted) with s.backward_scale                      the global mean's gradient
 *
 * Evaluation splits its batches over the ranks (batch k on rank k % procs) and sums its counts with
 * dist_sum. */

/* One banner line saying how the step is spread over processes (nothing for a job of one). */
void run_banner_dist(const TrainRun *r);

/* This rank's rows of a global batch of n rows (dist_split), also told to the backend so that dropout
 * draws the global batch's masks (dropout_batch_rows). */
DistRange run_batch_rows(TrainRun *r, int n);

typedef struct {
    double counted;       /* examples (targets) of the micro-batch that count, over all ranks */
    double loss_factor;   /* scale / counted: this rank's sum of losses times it is its part of the mean */
    float backward_scale; /* this rank's backward loss scale (it divides by its own count): scale * local / counted */
} RunShare;
/* This rank's share of a micro-batch's global mean loss, from host values alone (a sum over the ranks of the
 * counts): scale is 1, or 1/accum for gradient accumulation. Adds counted to the step's record. */
RunShare run_loss_share(TrainRun *r, double local_counted, double scale);

/* ------------------------------------------------------------------ the training-loop tail
 *
 * A step never waits for a GPU: its loss, correct predictions and gradient norm go into its record on the
 * device (StepRecord), and the host reads the records back, all at once, where it needs them: the steps that
 * log, evaluate, save a checkpoint or end an epoch, and a stop. What every family does, in this order:
 *
 *     run_step_begin(t); forward ... *_loss_into(&run_record(t)->loss)   (run_loss_share above)
 *     run_before_backward(t, micro_batch == accum - 1); backward ...     (for each micro-batch)
 *     run_optim_step(t, &h->optim, lr, t->iter + 1);
 *     if (read_due && run_read_records(t)) return 1;   t->recs[t->nrecs - 1] is this step's record
 *     double dt = run_step_done(t, t0, examples);
 *     log, evaluate ...
 *     int stop = run_checkpoint_or_stop(t, checkpoint_due);
 *     if (stop) return stop;
 *
 * and after the loop, run_read_records again before the final evaluation (a time budget ends the loop on any
 * step). Reading before run_step_done puts the wait for the device in the step's time: the steps between two
 * reads are timed together, as the GPU ran them. A non-finite loss is found at the next read: the steps after it
 * are thrown away with it, and the last good state (the last checkpoint, always read before it is written)
 * stays. */

/* This step's record in device memory (zeroed), for the ops that write into it: the family's *_loss_into and
 * *_correct_into, run_optim_step's norm. */
StepRecord *run_record(TrainRun *r);
/* Reads back every record written since the last read (one wait for the device) into t->recs[0 .. t->nrecs),
 * oldest first, the loss and correct counts summed over the ranks. A non-finite loss: run_check_loss for it
 * (the run fails with the family's loss_hint, naming the step) and 1; 0 otherwise (also when nothing is
 * unread, nrecs then 0). Every rank calls it at the same steps. */
int run_read_records(TrainRun *r);
/* run_read_records for the steps a loop left unread (a time budget ends it on any step), its wait for the
 * device counted as training time, as it is when a step reads: a run's tok/s covers all the work it queued. */
int run_read_last(TrainRun *r);

/* AdamW and gradient clipping; a family fills it from its Kconfig symbols with OPTIM_FROM_KCONFIG. */
typedef struct {
    double beta1, beta2, eps, weight_decay, clip; /* clip: max global gradient norm, 0 = off */
} Optim;

/* A family's AdamW symbols (beta1, beta2, epsilon, weight decay, clip), checked for range (an error names the
 * symbol). The symbols are named in full at the call, so that check-symbols and fixdep see them. */
#define OPTIM_FROM_KCONFIG(BETA1, BETA2, EPS, WEIGHT_DECAY, CLIP)                                                  \
    ((Optim){.beta1 = config_number(#BETA1, BETA1, 0.0, 0.999999), .beta2 = config_number(#BETA2, BETA2, 0.0, 0.999999), \
             .eps = config_number(#EPS, EPS, 1e-30, 1.0),                                                             \
             .weight_decay = config_number(#WEIGHT_DECAY, WEIGHT_DECAY, 0.0, 10.0),                                   \
             .clip = config_number(#CLIP, CLIP, 0.0, 1e9)})

/* Clips the gradients of w to o->clip (when on), then one AdamW update at learning rate lr as update number
 * step (1-based, for the bias correction). The global gradient norm before clipping goes into *norm (a double
 * in device memory). */
void optim_step(const Optim *o, Params *w, double lr, int step, double *norm);
/* Before each backward pass, saying whether it is the last of the optimizer step (the last micro-batch of
 * gradient accumulation; call it even when the pass is skipped): the last one's finished gradients start their
 * sum over the ranks while it goes on (train/grad_sync.h; nothing in a job of one or without buckets). */
void run_before_backward(TrainRun *r, int last);
/* optim_step for the run's parameters after the gradients are summed over the ranks (all-reduce; with
 * ZeRO-1 reduce-scatter, AdamW on this rank's slice, all-gather of the parameters), the norm into the step's
 * record. The loss must be normalised by the global count (run_loss_share). */
void run_optim_step(TrainRun *r, const Optim *o, double lr, int step);
/* At the start of every optimizer step, before its forward pass: a record for the step (run_record). With
 * KVLAB_PROFILE_STEPS=N in the environment the third step this process runs and the N-1 after it are timed op by
 * op (kernels.h, kprof_start), paused between steps (evaluation, logging and checkpoints are not counted); after
 * the last of them rank 0 prints where their time went and the metrics keep it under "profile" (train/profile.c). */
void run_step_begin(TrainRun *r);
/* train/profile.c's part of run_init (reads KVLAB_PROFILE_STEPS; a bad value stops the run with one line),
 * run_step_done and run_finish. */
void run_profile_init(TrainRun *r);
void run_profile_step_begin(TrainRun *r);
void run_profile_step_done(TrainRun *r);
void run_profile_finish(TrainRun *r);
/* A profile's rows (kernels.h, kprof_stop) over steps steps of step_ms each, per step: {"steps", "step_ms",
 * "ops_ms" (the ops' time in a step), "rows": [{"op", "part" (a GPU's kernels only), "calls", "ms"}]}, as a
 * run's metrics and bench_step's record hold them. The caller cJSON_Deletes it. */
cJSON *profile_json(const KprofRow *rows, int n, int steps, double step_ms);
/* Zeroes the AdamW moments (a family that starts its optimiser afresh, e.g. per seq2seq job). */
void run_reset_optimizer(TrainRun *r);

/* A non-finite training loss at iteration iter: marks the metrics failed, prints one error line with the
 * family's loss_hint and where the last good state is, and returns 1. Returns 0 for a finite loss. */
int run_check_loss(TrainRun *r, double loss, int iter);
/* Counts a finished optimiser step that began at wall time t0 (when run_step_begin was called) and saw the given
 * examples (global); returns its seconds, the slowest rank's, so that every rank keeps the same clock for time
 * budgets. */
double run_step_done(TrainRun *r, double t0, double examples);
/* Saves the state when due (a checkpoint line on stdout), then honours a stop request (any rank's): returns
 * run_stop()'s exit status when the run must stop now, 0 to go on. */
int run_checkpoint_or_stop(TrainRun *r, int checkpoint_due);

void format_eta(char *buf, size_t n, double seconds);
/* exp(min(loss, 20)) */
double perplexity(double loss);

#endif
