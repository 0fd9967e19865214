/* The paper's synthetic sequence tasks on digits 0-9 (attention-variants.md
 * 7.1): inputs x_t drawn uniformly from {0..9}, labels per task. */
#ifndef KVLAB_SEQ2SEQ_TASKS_H
#define KVLAB_SEQ2SEQ_TASKS_H

#include <stdint.h>

typedef enum { TASK_REVERSE, TASK_SORT, TASK_SWAP, TASK_SUB, TASK_COPY, NUM_TASKS } SynthTask;

const char *task_name(SynthTask t);
/* Task from its name ("reverse", ...), -1 if unknown. */
int task_from_name(const char *name);
/* y from x for one sequence of length T:
 *   reverse y_t = x_{T-1-t}; sort = ascending sort of x; swap = x[T/2:] then x[:T/2];
 *   sub y_t = 9 - x_t; copy y = x. */
void task_labels(SynthTask t, const int *x, int T, int *y);
/* n sequences of length T from (seed, stream): x uniform digits, y labels. */
void task_generate(SynthTask t, int n, int T, uint64_t seed, uint64_t stream, int *x, int *y);

#endif
