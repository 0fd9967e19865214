/* Experiment tracking for the trainers of every family: the glue between
 * the Kconfig menu "Experiment tracking", train/trainer.c and the W&B client
 * (wandb/wandb.h). The trainer calls the tracking_* hooks itself (when the
 * metrics file is opened, written, finished), so a family needs no code of
 * its own: every series it appends to the metrics document is reported.
 *
 * One W&B run per training process of a step: group = CONFIG_RUN_NAME, job
 * type = the step, config = the resolved configuration plus family,
 * variant, dataset and model. Its spool: <out>/wandb/<step>/wandb-c/<id>/. */
#ifndef KVLAB_TRACKING_H
#define KVLAB_TRACKING_H

#include "trainer.h"

#if IS_ENABLED(CONFIG_WANDB)
/* (The W&B client, wandb/wandb.h, is tracking.c's: code above train/, mechint, sees these hooks only.) */

/* Starts the W&B run of r (run_open_metrics). */
void tracking_start(TrainRun *r);
/* Reports the values appended to r's metrics since the last call, at step r->iter (run_write_metrics). */
void tracking_log(TrainRun *r);
/* Final numbers of the metrics document as the summary, the metrics file
 * as a run file, then completion with exit_code (run_finish, run_fail). */
void tracking_finish(TrainRun *r, int exit_code);

/* For analyses of a finished step (mechint): attaches summary_json (a flat
 * JSON object of numbers, may be NULL) and the files (uploaded as
 * <folder>/<file name>) to the W&B run of `step` under run_dir, the one the
 * newest spool in <run_dir>/wandb/<step>/ belongs to. Uploads at once when
 * tracking is online, else make wandb-sync does it later. Returns 0 when
 * attached, 1 when that step has no W&B run (tracking was off), -1 after
 * printing one line saying why not. */
int tracking_attach_results(const char *run_dir, const char *step, const char *summary_json,
                            const char *const *files, int nfiles, const char *folder);
#else
/* Tracking is off: neither these hooks nor the W&B client are linked. */
static inline void tracking_start(TrainRun *r) { (void)r; }
static inline void tracking_log(TrainRun *r) { (void)r; }
static inline void tracking_finish(TrainRun *r, int exit_code) { (void)r, (void)exit_code; }
static inline int tracking_attach_results(const char *run_dir, const char *step, const char *summary_json,
                                          const char *const *files, int nfiles, const char *folder) {
    (void)run_dir, (void)step, (void)summary_json, (void)files, (void)nfiles, (void)folder;
    return 1;
}
#endif

#endif
