/* Weights & Biases client (libcurl + cJSON): run creation, metrics history,
 * summary, file uploads and completion, with an offline spool that
 * `wandb_sync` (make wandb-sync) uploads later. Usage: docs/wandb.md.
 *
 * Never makes training fail: problems are reported as one "wandb: ..." line
 * on stderr and the run carries on with the local spool only. All network
 * traffic runs on one worker thread; the calling thread only queues and
 * appends to the spool, except for the bounded waits in wandb_init (run
 * creation) and wandb_finish. Call every function of one run from one thread.
 */
#ifndef KVLAB_WANDB_H
#define KVLAB_WANDB_H

#include "common.h"

typedef struct {
    const char *mode;        /* "online" | "offline" | "disabled"; $WANDB_MODE overrides */
    const char *base_url;    /* NULL: $WANDB_BASE_URL, else https://api.wandb.ai */
    const char *api_key;     /* NULL: $WANDB_API_KEY, else netrc ($NETRC, ~/.netrc) for the base URL's host[:port] */
    const char *entity, *project, *name, *group, *job_type, *notes; /* NULL = unset; env vars override */
    const char *tags;        /* comma separated; $WANDB_TAGS overrides */
    const char *commit;      /* git commit recorded with the run; NULL = unset */
    const char *run_id;      /* NULL: $WANDB_RUN_ID, else 8 random [a-z0-9] */
    const char *dir;         /* spool root (NULL: $WANDB_DIR, else ./wandb): <dir>/wandb-c/<run_id>/ */
    const char *config_json; /* JSON object: the run config (each top-level key becomes {"value": ...}) */
    double flush_interval_s; /* 0 = default 10; also spaces FileStream requests by min(1 s, this) */
    double heartbeat_s;      /* 0 = default 30 */
    double finish_timeout_s; /* 0 = default 120 */
    double retry_min_s, retry_max_s; /* 0 = defaults 2 and 60 */
    double init_timeout_s;   /* bound on run creation in wandb_init; 0: $WANDB_INIT_TIMEOUT, else 90 */
    double connect_grace_s;  /* refused connections (nothing listening) end a bounded wait after this long;
                              * 0: $WANDB_CONNECT_GRACE, else 5 */
    double http_timeout_s;   /* per GraphQL attempt; 0: $WANDB_HTTP_TIMEOUT, else 30 */
    double filestream_timeout_s; /* per FileStream attempt; 0 = default 180 */
    long request_bytes;      /* history bytes per FileStream request; 0 = default 10 MiB (tests use less) */
} WandbSettings;

typedef struct WandbRun WandbRun;

/* Starts a run: creates the spool, and when online creates the run on the
 * server (bounded by init_timeout_s) and starts the upload thread. On any
 * problem prints one line and continues with the spool only; when nothing
 * listens at the server's address (connections refused for connect_grace_s),
 * the upload thread keeps trying and uploads everything once it answers.
 * Returns NULL only for mode "disabled"; every function below accepts NULL
 * and does nothing. */
WandbRun *wandb_init(const WandbSettings *s);
/* Sets key = value in the row of `step`. Logging a higher step closes the open
 * row; values for a step at or below the last closed one are dropped and counted.
 * Keys must not start with '_'; '/' groups charts (train/loss, eval/loss). */
void wandb_log(WandbRun *r, long step, const char *key, double value);
/* Closes the row of `step` (adds _step, _runtime, _timestamp), appends it to
 * the spool and the upload queue, and updates the summary. */
void wandb_commit(WandbRun *r, long step);
/* An explicit summary value (best/eval_loss, final/...); later history values of the same key replace it. */
void wandb_summary_set(WandbRun *r, const char *key, double value);
/* Copies local_path into the spool as run_path (relative, '/'-separated) and
 * uploads it when online. Returns 0, or -1 after printing why. */
int wandb_upload_file(WandbRun *r, const char *local_path, const char *run_path);
/* 1 once the server said the run was stopped from the web UI. */
int wandb_should_stop(const WandbRun *r);
/* The run's web page, or NULL while the run does not exist on the server. */
const char *wandb_run_url(const WandbRun *r);
/* <dir>/wandb-c/<run_id>/ (a "-2", "-3" suffix when that folder already exists), or NULL without a spool. */
const char *wandb_spool_dir(const WandbRun *r);
/* Flushes everything, uploads the final summary and files, marks the run
 * finished (exit_code 0) or failed, and frees r. Bounded by finish_timeout_s;
 * nothing is sent afterwards. Whatever was not acknowledged stays in the
 * spool and a line says to run make wandb-sync. */
void wandb_finish(WandbRun *r, int exit_code);

/* Uploads one spool folder (an offline run, or one whose online upload
 * stopped): resumes from its sync_state.json, never sends a row twice at
 * different offsets, and records acknowledged offsets after every answer.
 * Prints one line with the run's URL on success; returns -1 with e set on failure. */
int wandb_sync_dir(const char *spool_dir, const WandbSettings *s, Err *e);

/* Attaches results computed after the run ended (mechint) to the run of the
 * newest spool under spool_root (<spool_root>/wandb-c/<run_id>/): the
 * numbers of summary_json (a flat JSON object; may be NULL) join its
 * summary, the files are copied into the spool as <folder>/<file name>. In
 * mode online the run is then synced at once (a new session of the same
 * run: its summary, the new files, completion with its exit code again);
 * otherwise, or when that fails, make wandb-sync uploads them later.
 * Returns 0 when attached, 1 when there is no spool or the mode is
 * "disabled" (nothing done), -1 with e set on failure. */
int wandb_attach_spool(const char *spool_root, const char *summary_json, const char *const *files, int nfiles,
                       const char *folder, const WandbSettings *s, Err *e);

#endif
