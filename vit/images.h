/* Image classification data sets in memory: IDX files (MNIST,
 * Fashion-MNIST; formats.md §3) and CIFAR binary batches (§4), plus the ViT
 * input step that cuts an image into normalised patches. The loaders reject
 * anything a damaged or mismatched download can get wrong, with one-line
 * errors "<path>: <problem> (hint: ...)". Link with -lz. */
#ifndef KVLAB_IMAGES_H
#define KVLAB_IMAGES_H

#include <stdint.h>

#include "common.h"

typedef struct {
    int n, h, w, c;   /* images, height, width, channels */
    int classes;      /* number of classes */
    uint8_t *pixels;  /* n * h * w * c bytes, each image stored channel-planar (c planes of h*w), row-major */
    uint8_t *labels;  /* n labels in [0, classes) */
} ImageSet;

/* Frees the arrays and zeroes *s (safe on a zeroed or failed set). */
void imageset_free(ImageSet *s);

/* An IDX pair: images (magic 0x00000803, u8, n x h x w) and labels (magic
 * 0x00000801, u8, n), each plain or gzip-compressed. The size after
 * decompression must be exactly 4 + 4k + prod(dims); the counts must agree and
 * every label must be below classes = 10. c = 1. On failure *s is left zeroed. */
int imageset_load_idx(ImageSet *s, const char *images_path, const char *labels_path, Err *e);

/* CIFAR binary batches, concatenated in the order given (e.g. data_batch_1..5).
 * cifar100 = 0: CIFAR-10 records of 3073 bytes (label, 3072 planar pixels),
 * 10 classes; cifar100 = 1: CIFAR-100 records of 3074 bytes (coarse label,
 * fine label, pixels), keeping the fine label, 100 classes. Each file must be
 * a non-empty whole number of records; labels are range-checked (the coarse
 * CIFAR-100 label against its 20 classes too). h = w = 32, c = 3. On failure
 * *s is left zeroed. */
int imageset_load_cifar(ImageSet *s, const char *const *paths, int npaths, int cifar100, Err *e);

/* Per-channel mean and population standard deviation of the pixels scaled to
 * [0, 1], over the whole set; mean and std get c values each. The sums are
 * exact integers, so the result does not depend on the order of images. */
void imageset_channel_stats(const ImageSet *s, double *mean, double *std);

/* ViT patches of image i: p x p patches in row-major grid order, each a vector
 * of p*p*c floats ordered (row, column, channel) with the channel fastest, and
 * values (x/255 - mean[ch]) / std[ch]. out gets (h/p)*(w/p) such rows. h and w
 * must be multiples of p (asserted; check them when configuring).
 * Augmentation: flip = 1 mirrors the image horizontally first; then output
 * pixel (y, x) reads the (mirrored) source at (y + dy, x + dx), and positions
 * outside the image give 0 after normalisation (padding with the mean). A
 * random 32x32 crop of an image padded by 4 is dy, dx uniform in [-4, 4]. */
void imageset_patchify(const ImageSet *s, int i, int p, const double *mean, const double *std, int flip, int dy, int dx,
                       float *out);

#endif
