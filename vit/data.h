/* ViT data: the configured image data set, a seeded validation split of its
 * training images, per-dataset normalisation, and batches of patches. */
#ifndef KVLAB_VIT_DATA_H
#define KVLAB_VIT_DATA_H

#include <stdint.h>

#include "common.h"
#include "images.h"

typedef struct {
    const char *name;             /* "fashion-mnist", "mnist", "cifar10", "cifar100" */
    ImageSet train, test;         /* train holds the training and validation images */
    int *train_idx, *val_idx;     /* disjoint index lists into train */
    int ntrain, nval;
    double mean[3], std[3];       /* per-channel normalisation */
    int augment;                  /* random crop and flip for training batches */
    const char *const *class_names;
} VitData;

/* Loads the configured data set from data_dir (Fashion-MNIST from the
 * Debian package folder) and splits val_images off the training images
 * with a permutation drawn from seed. */
int vit_data_load(VitData *d, const char *data_dir, int val_images, uint64_t seed, Err *e);
/* The same for an explicit data set (tests). */
int vit_data_from_sets(VitData *d, const char *name, ImageSet train, ImageSet test, int val_images, uint64_t seed,
                       int reference_norm, int augment, Err *e);
void vit_data_free(VitData *d);

/* Patches (count, N, P*P*c) and labels of images idx[0..count) of set.
 * With augmentation on, image k gets a flip and a shift drawn from
 * (aug_seed, idx[k]), so a batch depends only on the seed, never on order. */
void vit_batch(const VitData *d, const ImageSet *set, const int *idx, int count, int P, int augment,
               uint64_t aug_seed, float *patches, int *labels);

/* JSON list of the class names (checkpoint metadata). */
char *vit_labels_json(const VitData *d);

#endif
