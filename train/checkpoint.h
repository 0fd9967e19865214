/* kvlab checkpoints (safetensors).
 *
 * A model describes its parameters as a ParamTable (nn/params.h): names,
 * shapes and offsets into one contiguous buffer. Checkpoints store every
 * tensor under its name plus string
 * metadata (family, variant, the resolved configuration, ...). A resumable
 * state file adds the AdamW moments as "optim.m.<name>" / "optim.v.<name>".
 * Loading is strict: a foreign file, another family or variant, a missing,
 * extra or misshaped tensor, a tensor whose bytes do not match its CRC-32
 * (metadata CHECKPOINT_CRC_KEY; files without it load unchecked), or a
 * non-finite value is an error naming the file and the problem. */
#ifndef KVLAB_CHECKPOINT_H
#define KVLAB_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "params.h"
#include "safetensors.h"

#define CHECKPOINT_FORMAT_VERSION "1"
/* Metadata key holding {"<tensor>": "<CRC-32 of its bytes, 8 hex digits>"}.
 * Not a format change: readers that predate it ignore the key. */
#define CHECKPOINT_CRC_KEY "tensor_crc32"

/* Writes params (and, if m and v are given, the AdamW moments) with the
 * metadata pairs; "framework", "format_version" and CHECKPOINT_CRC_KEY are
 * added. Atomic. */
int checkpoint_save(const char *path, const ParamTable *t, const float *params, const float *m, const float *v,
                    const StMeta *meta, int nmeta, Err *e);

/* Whether params (and m, v when given) are all finite, as checkpoint_read requires: otherwise an error naming
 * the tensor a writer would have put in path (which it then leaves as it is). A state written from a diverged
 * run would replace the last good resume point with one that no reader takes. */
int checkpoint_finite(const char *path, const ParamTable *t, const float *params, const float *m, const float *v,
                      Err *e);

/* Opens a checkpoint and checks it is a kvlab checkpoint of this family. */
StFile *checkpoint_open(const char *path, const char *family, Err *e);
/* Checks that the metadata key holds want; the error says what the file has. */
int checkpoint_expect(StFile *f, const char *key, const char *want, const char *hint, Err *e);
/* Compares the JSON object in metadata key with want_json field by field;
 * the error names the first field that differs and both values. */
int checkpoint_expect_json(StFile *f, const char *key, const char *want_json, const char *hint, Err *e);
/* Reads every tensor of t into params (m and v too when non-NULL), each
 * checked against its CRC-32 when the file has CHECKPOINT_CRC_KEY. The table's
 * alignment gaps (nn/params.h) are left as they are: callers pass zeroed buffers. */
int checkpoint_read(StFile *f, const ParamTable *t, float *params, float *m, float *v, Err *e);
/* The same for a model's device buffers (nn/params.h), staged through host
 * memory: parameters, plus the AdamW moments when `moments` is set. Reading
 * is all or nothing: on an error the buffers keep their values. */
int checkpoint_save_params(const char *path, const Params *p, int moments, const StMeta *meta, int nmeta, Err *e);
int checkpoint_read_params(StFile *f, Params *p, int moments, Err *e);
/* A model's parameters from a checkpoint of this family, variant and model
 * description (open, the two checks with their hints, read, close). Where
 * dataset and tokenizer are non-NULL the checkpoint's metadata must name the
 * same ones too: MNIST and Fashion-MNIST models have one shape, and a model
 * read with another vocabulary of its size decodes into nonsense. */
int checkpoint_load_model(const char *path, const char *family, const char *variant, const char *variant_hint,
                          const char *model_json, const char *model_hint, const char *dataset, const char *tokenizer,
                          Params *p, Err *e);

#endif
