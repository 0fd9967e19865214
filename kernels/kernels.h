/* kernels: the backend-neutral compute interface used by every model family.
 *
 * Model code calls only these functions. A backend (kernels/cpu/ today, a
 * CUDA one later) implements all of them for buffers from dev_alloc(), which
 * live wherever the backend computes. Conventions, as in llm.c:
 *  - activations are row-major (N, C) with N = B*T rows;
 *  - linear weights are (OC, C) ("out, in"), so out = inp W^T + b;
 *  - every *_backward ACCUMULATES (+=) into the gradients it is given, so
 *    gradients from several uses (residual branches, tied weights, roles
 *    that share a projection) add up; the caller zeroes them once per step;
 *  - bad shapes or arguments stop the program with a message naming the op;
 *  - every pointer argument is device memory (dev_alloc), token ids, targets
 *    and masks too; the few results returned by value (a count, a norm) are
 *    host values, so on an asynchronous backend those calls wait for the
 *    device: call them once per step, not per op;
 *  - activations, and the gradients of activations, are act_t (below);
 *    parameters, their gradients and AdamW moments, layernorm statistics,
 *    losses and log-sum-exps are float.
 * Attention has its own header, kernels/attention.h. */
#ifndef KVLAB_KERNELS_H
#define KVLAB_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* ---- the element type of activations -------------------------------------
 * act_t is what the activations between ops are stored as: the (rows,
 * channels) inputs and outputs of the ops below and their gradients,
 * attention's projections and outputs, the KV cache. float, except in the
 * CUDA target's bf16 mixed precision (CUDA_BF16), where it is bf16 (2
 * bytes) while everything else stays float. So model code sizes activation
 * buffers with sizeof(act_t), never reads or writes one of their elements
 * on the host (act_upload and act_download convert from and to float on
 * the way) and never hands one where a float buffer is asked for.
 * `make check-act` (check-act in scripts/Makefile.build, part of make test)
 * compiles the code above the kernels with KVLAB_ACT_CHECK defined: act_t
 * is then a 2-byte struct, so that mixing it with float, arithmetic on its
 * values and byte copies of it with dev_upload / dev_download do not
 * compile (a CUDA_BF16 build compiles that code against the same struct). */
#if IS_ENABLED(CONFIG_CUDA_BF16)
#define KVLAB_ACT_BYTES 2 /* bf16: C sees its bits, the CUDA sources (C++, cuda_bf16.h first) __nv_bfloat16 */
#else
#define KVLAB_ACT_BYTES 4
#endif
#if defined(__cplusplus) && KVLAB_ACT_BYTES == 2
typedef __nv_bfloat16 act_t;
#elif defined(KVLAB_ACT_CHECK) || KVLAB_ACT_BYTES == 2
typedef struct {
    unsigned short bits;
} act_t;
#else
typedef float act_t;
#endif

/* ---- backend ---------------------------------------------------------- */

/* Starts the backend with nthreads threads (0 = one per core). */
void backend_init(int nthreads);
const char *backend_name(void);
int backend_threads(void);

void *dev_alloc(size_t bytes);          /* zero-filled */
/* Bytes dev_alloc has been asked for since the start (never decreases: frees are not subtracted), so the
 * difference across a call is what it allocated: tests and benchmarks check that a variant allocates only
 * the memory it needs (the KV cache). Host code only, not thread-safe. */
size_t dev_alloc_total(void);
void dev_free(void *p);
/* Memory of a GPU backend: the most bytes held at once in live dev_alloc buffers since the start, and the
 * device's capacity. Both 0 on a backend whose device memory is host memory (the CPU: there it is part of
 * the process's peak RSS). Host code only. */
size_t dev_mem_peak(void);
size_t dev_mem_capacity(void);
/* Starts dev_mem_peak over from the bytes live now (a benchmark measures one phase's peak). */
void dev_mem_peak_reset(void);
void dev_zero(void *p, size_t bytes);
/* host_src may be reused as soon as dev_upload returns; on a GPU a small upload
 * (a batch) is staged and queued without waiting for the device, a large one
 * waits (docs/cuda.md). dev_download returns with the bytes in host_dst. */
void dev_upload(void *dst, const void *host_src, size_t bytes);
void dev_download(void *host_dst, const void *src, size_t bytes);
/* device to device; the two ranges must not overlap */
void dev_copy(void *dst, const void *src, size_t bytes);
/* n activations from float host memory, and back to float host memory. */
void act_upload(act_t *dst, const float *host_src, size_t n);
void act_download(float *host_dst, const act_t *src, size_t n);
#ifdef KVLAB_ACT_CHECK
/* an activation buffer crosses to or from the host only through act_upload / act_download */
#define KVLAB_NOT_ACT(p)                                                                                    \
    ((void)sizeof(struct {                                                                                  \
        _Static_assert(_Generic((p), act_t *: 0, const act_t *: 0, default: 1),                            \
                       "activations cross to and from the host with act_upload / act_download");           \
        int x;                                                                                              \
    }))
#define dev_upload(dst, src, bytes) (KVLAB_NOT_ACT(dst), dev_upload(dst, src, bytes))
#define dev_download(dst, src, bytes) (KVLAB_NOT_ACT(src), dev_download(dst, src, bytes))
#endif
/* rows x cols activations from src (row stride src_ld) to dst (row stride
 * dst_ld), both device memory, not overlapping: e.g. appending one position
 * of N sequences to a KV cache */
void dev_copy_rows(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, int rows, size_t cols);
/* dst row i = src row idx[i] for i < n (idx: n ints in device memory), cols
 * activations per row, row strides dst_ld and src_ld; dst must not overlap src:
 * e.g. reordering beam-search caches, or one source row per beam */
void rows_gather(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, const int *idx, int n, size_t cols);

/* ---- embedding: out[b,t,:] = scale * wte[tokens[b,t],:] + wpe[t,:] ------
 * scale is 1 for GPT-2, sqrt(C) for the translation model; wpe may be a
 * fixed table (sinusoidal), then dwpe is NULL, or NULL (positions enter in
 * attention: RoPE, ALiBi, relative bias). A token outside [0, V) stops the
 * program with one line naming it and its position: on a GPU at the next
 * call that waits for the device (a download, a returned value); until then
 * neither op reads or writes a row for it (the backward pass adds nothing to
 * dwte for it), so nothing waits for the answer. */
void embedding_forward(act_t *out, const int *tokens, const float *wte, const float *wpe,
                       int B, int T, int C, int V, float scale);
void embedding_backward(float *dwte, float *dwpe, const act_t *dout, const int *tokens,
                        int B, int T, int C, int V, float scale);

/* ---- token assembly for encoders (ViT): out (B, T, C) --------------------
 * With cls: out[b,0] = cls + pos[0], out[b,1+i] = x[b,i] + pos[1+i] (x has
 * T-1 tokens); without: out[b,i] = x[b,i] + pos[i] (x has T tokens).
 * pos may be NULL (no absolute positions). Backward adds to dx, dpos (unless
 * NULL: a fixed table or none) and (if given) dcls. */
void tokens_embed_forward(act_t *out, const act_t *x, const float *cls, const float *pos, int B, int T, int C);
void tokens_embed_backward(act_t *dx, float *dcls, float *dpos, const act_t *dout, int B, int T, int C);

/* ---- pooling: out[b] = mean of inp[b, first .. first+count-1] (B, C) ------ */
void pool_tokens_forward(act_t *out, const act_t *inp, int B, int T, int C, int first, int count);
void pool_tokens_backward(act_t *dinp, const act_t *dout, int B, int T, int C, int first, int count);

/* ---- layernorm over the last dim, eps 1e-5, biased variance -------------
 * mean and rstd (N floats each) are saved for the backward pass; b may be
 * NULL (no bias), then db must be NULL too. */
void layernorm_forward(act_t *out, float *mean, float *rstd, const act_t *inp,
                       const float *w, const float *b, int N, int C);
void layernorm_backward(act_t *dinp, float *dw, float *db, const act_t *dout, const act_t *inp,
                        const float *w, const float *mean, const float *rstd, int N, int C);
/* A residual add and the layernorm after it, fused: res = a + b (kept: the
 * layernorm's input for its backward pass and the next residual's), then
 * out = layernorm(res); the very values of residual_forward followed by
 * layernorm_forward, in one pass over the rows on a GPU. res may be a. */
void residual_layernorm_forward(act_t *res, act_t *out, float *mean, float *rstd, const act_t *a, const act_t *b,
                                const float *w, const float *bias, int N, int C);

/* ---- linear: out (N,OC) = inp (N,C) W^T + b, one matrix product (sgemm) ----
 * b may be NULL (then db must be NULL). dinp may be NULL when the input
 * needs no gradient (e.g. the first layer's input is data); dw and db may be
 * NULL when the weights need none (an analysis that differentiates only
 * other weights, nn/params.h attn_grads_only): their product is skipped.
 * out is not inp. */
void linear_forward(act_t *out, const act_t *inp, const float *w, const float *b,
                    int N, int C, int OC);
void linear_backward(act_t *dinp, float *dw, float *db, const act_t *dout, const act_t *inp,
                     const float *w, int N, int C, int OC);

/* ---- activations (elementwise over n values) ---------------------------- */

/* GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
void gelu_forward(act_t *out, const act_t *inp, size_t n);
void gelu_backward(act_t *dinp, const act_t *inp, const act_t *dout, size_t n);
void relu_forward(act_t *out, const act_t *inp, size_t n);
void relu_backward(act_t *dinp, const act_t *inp, const act_t *dout, size_t n);

/* ---- a linear layer and the GELU after it, fused where the backend can ----
 * (the MLP's two matrix products; on a GPU the bias, the GELU and its
 * derivative run in the matmul's epilogue, docs/cuda.md):
 * linear_gelu_forward: pre = inp W^T + b (kept for the backward pass) and
 *   out = gelu(pre); the values of linear_forward then gelu_forward.
 * gelu_linear_backward: the backward of the layer y = gelu(pre) W^T + b that
 *   reads the GELU's output act = gelu(pre): dw += dout^T act, db += the
 *   column sums of dout, and dpre = gelu'(pre) * (dout W), which overwrites
 *   dpre (it is not added); the values of linear_backward into a zeroed
 *   buffer then gelu_backward into another. dw and db may be NULL, as there.
 * pre, out and inp are three buffers; dpre is none of pre, act and dout (nor are act and dout one). */
void linear_gelu_forward(act_t *pre, act_t *out, const act_t *inp, const float *w, const float *b,
                         int N, int C, int OC);
void gelu_linear_backward(act_t *dpre, float *dw, float *db, const act_t *dout, const act_t *act,
                          const act_t *pre, const float *w, int N, int C, int OC);

/* ---- residual add: out = a + b. No backward op: the block passes dout on to
 * both inputs, whose backward ops accumulate into the same gradient buffer. */
void residual_forward(act_t *out, const act_t *a, const act_t *b, size_t n);

/* ---- dropout --------------------------------------------------------------
 * Inverted dropout with probability p. The keep/drop decision of element i
 * is a hash of (seed, i): nothing is stored, the backward pass recomputes
 * it, and results do not depend on the thread count. Use a different seed
 * per call site and step (dropout_seed). out may alias inp. */
uint64_t dropout_seed(uint64_t run_seed, uint64_t step, uint64_t site);
void dropout_forward(act_t *out, const act_t *inp, size_t n, float p, uint64_t seed);
void dropout_backward(act_t *dinp, const act_t *dout, size_t n, float p, uint64_t seed);
/* Data-parallel training (train/dist.h): the batch of the following passes is rows [first, first + count) of
 * a global batch. Dropout then decides element i of a buffer of n values whose leading dimension is that
 * batch as element i + first * (n / count) of the global buffer, so the masks do not depend on how many
 * processes share the batch; n must be a multiple of count. Attention-probability dropout adds first to
 * its batch index (dropout_batch_first). (0, 0), the default: the batch is all there is. */
void dropout_batch_rows(int first, int count);
int dropout_batch_first(void);

/* ---- softmax cross-entropy over V classes ----------------------------------
 * Row loss with label smoothing eps (PyTorch's definition: target mass
 * (1-eps) on the gold class plus eps/V on every class):
 *   loss = lse - (1-eps) x[gold] - eps mean(x)
 * Rows whose target equals ignore_index (use -1 for none) get loss 0 and no
 * gradient. lse (N floats) is saved for the backward pass. The losses stay
 * on the device; how many rows count (targets != ignore_index) the caller
 * knows from its own targets (targets_counted, lib/common.h), so the op
 * returns nothing and a GPU is not waited for. */
void crossentropy_forward(float *losses, float *lse, const act_t *logits, const int *targets,
                          int N, int V, int ignore_index, float smoothing);
/* dlogits = (softmax(x) - target distribution) * scale for counted rows,
 * scale is typically 1/(counted rows) (times 1/grad-accum steps). dlogits
 * may alias logits (computed in place: the logits are not needed again). */
void crossentropy_backward(act_t *dlogits, const act_t *logits, const float *lse,
                           const int *targets, int N, int V, int ignore_index,
                           float smoothing, float scale);
/* Adds to *acc (one double in device memory) the number of rows whose
 * argmax equals the target (ignoring ignore_index rows); the first index of
 * the maximum wins a tie. Nothing comes back to the host. */
void argmax_correct_into(double *acc, const act_t *logits, const int *targets, int N, int V, int ignore_index);
/* The same count returned (waits for a GPU: evaluation, tests). */
int argmax_correct(const act_t *logits, const int *targets, int N, int V, int ignore_index);
/* *acc += scale * (x[0] + ... + x[n-1]), summed in double in a fixed order
 * (a run repeats bit for bit), acc one double in device memory: a training
 * step's loss stays on the device until its trainer reads it. */
void sum_into(double *acc, const float *x, size_t n, double scale);
/* The same sum returned (waits for a GPU). */
double sum_of(const float *x, size_t n);

/* ---- optimiser --------------------------------------------------------------
 * AdamW (decoupled weight decay, bias correction) on n values; t is the
 * 1-based step. Weight decay is the caller's choice per tensor (matrices
 * only, by convention). */
void adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int t);
/* The same update of many tensors in one call (a GPU launches once for up to
 * a hundred of them, not once per tensor): span k covers spans[k].n values,
 * param and grad from spans[k].offset, m and v from spans[k].state_offset,
 * with its own weight decay. Each value gets exactly adamw_update's
 * arithmetic. */
typedef struct {
    size_t offset, state_offset, n;
    float weight_decay;
} AdamwSpan;
void adamw_update_spans(float *param, const float *grad, float *m, float *v, const AdamwSpan *spans, int nspans,
                        float lr, float beta1, float beta2, float eps, int t);
void scale_inplace(float *x, size_t n, float s);
/* *norm (one double in device memory) := the global L2 norm of n gradient
 * values (accumulated in double); with max_norm > 0, clips like
 * torch.nn.utils.clip_grad_norm_: scales by max_norm / (norm + 1e-6) when
 * norm > max_norm, the decision taken on the device (no host wait). */
void clip_grad_norm_into(float *grad, size_t n, double max_norm, double *norm);
/* clip_grad_norm_into in two halves, for gradients split over the ranks of a
 * job (ZeRO-1: the global norm is the root of the sum over the ranks of each
 * slice's squares, summed on the device between the halves):
 * grad_sumsq_into writes the sum of the squares of n values (in double) into
 * *sumsq; clip_grad_sumsq_into writes *norm := sqrt(*sumsq) and clips n
 * values against it as clip_grad_norm_into does. Both doubles are in device
 * memory, and may be the same one; nothing waits for a GPU. */
void grad_sumsq_into(const float *grad, size_t n, double *sumsq);
void clip_grad_sumsq_into(float *grad, size_t n, double max_norm, const double *sumsq, double *norm);
/* clip_grad_norm_into with the norm returned (waits for a GPU):
 * clip_grad_norm clips (max_norm > 0), grad_norm only measures. */
double clip_grad_norm(float *grad, size_t n, double max_norm);
double grad_norm(const float *grad, size_t n);

/* ---- profile: where a step's time goes (make bench BENCH_ARGS=--profile) --
 * Between kprof_start and kprof_stop the backend times every call of this
 * interface and of attention.h: the outermost call only, where one op calls
 * another, on the device's clock. On the CPU that is the wall clock around
 * the call. On a GPU it is the time between two events queued on its stream
 * around the call: the GPU's time while the host keeps work queued ahead of
 * it, and, where the GPU waits for the host (a small model; an op that waits
 * for a value it returns), the host's time inside the call too. A GPU
 * backend also times each kernel and cuBLAS product inside a call as its
 * part, from the end of the part before (so a copy queued before a launch
 * counts in that launch's part). kprof_stop waits for the device and
 * returns the totals: one row per op (part NULL) and one per (op, part), in
 * order of first use; *rows lives until the next kprof_start. Without a
 * profile running it returns 0 rows (and *rows NULL). Off, an op costs two
 * calls that test a flag. Host code only, one host thread.
 * Each time the host waits for a GPU inside an op (a download; a large
 * upload whose host buffer is reused at once; the value an op returns), the
 * backend ends a part named KPROF_HOST_WAIT: a profile counts a step's
 * round trips by those parts' calls (profile_json's "host_waits"). */
#define KPROF_HOST_WAIT "host wait"
typedef struct {
    const char *op, *part; /* interface function; kernel or cuBLAS call inside it (GPU), NULL for the op itself */
    long calls;
    double ms;
} KprofRow;
void kprof_start(void);
int kprof_stop(const KprofRow **rows);
/* Between them the profile counts nothing and keeps its totals (a trainer's evaluation between steps). */
void kprof_pause(void);
void kprof_resume(void);
/* After kprof_stop: the time the last profile was on (kprof_start or
 * kprof_resume to kprof_pause or kprof_stop), on the ops' clock: on a GPU
 * the device's time for the work queued meanwhile, gaps where it waited for
 * the host included, so the ops' ms never exceed it however far the host
 * ran ahead; on the CPU the wall time. */
double kprof_on_ms(void);

#endif
