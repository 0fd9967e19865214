#include "data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

/* Where Debian's dataset-fashion-mnist package installs the files. */
#define FMNIST_DIR "/usr/share/datasets/fashion-mnist"

static const char *const FMNIST_CLASSES[] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                             "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
static const char *const DIGITS[] = {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
static const char *const CIFAR10_CLASSES[] = {"airplane", "automobile", "bird",  "cat",  "deer",
                                              "dog",      "frog",       "horse", "ship", "truck"};

/* dir/sub/prefix-{images,labels}-... (sub may be ""). The folder comes in two parts, not joined into a buffer
 * first: a joined 4096-byte buffer as the prefix of another one is a truncation gcc warns of, which stopped every
 * MNIST build (CONFIG_DATA_DIR is at most 1024 bytes, scripts/kconfig.py). */
static int load_idx_pair(ImageSet *s, const char *dir, const char *sub, const char *prefix, const char *hint,
                         Err *e) {
    char img[4096], lab[4096];
    const char *sep = *sub ? "/" : "";
    snprintf(img, sizeof img, "%s%s%s/%s-images-idx3-ubyte.gz", dir, sep, sub, prefix);
    snprintf(lab, sizeof lab, "%s%s%s/%s-labels-idx1-ubyte.gz", dir, sep, sub, prefix);
    Err le;
    if (imageset_load_idx(s, img, lab, &le) != 0) return err_with_hint(e, &le, hint);
    return 0;
}

static int load_cifar(ImageSet *train, ImageSet *test, const char *data_dir, int cifar100, Err *e) {
    char paths[5][4096];
    const char *p[5];
    const char *hint = cifar100 ? "scripts/get_data.sh cifar100 downloads it" : "scripts/get_data.sh cifar10 downloads it";
    Err le;
    if (cifar100) {
        snprintf(paths[0], sizeof paths[0], "%s/cifar100/cifar-100-binary/train.bin", data_dir);
        p[0] = paths[0];
        if (imageset_load_cifar(train, p, 1, 1, &le) != 0) return err_with_hint(e, &le, hint);
        snprintf(paths[0], sizeof paths[0], "%s/cifar100/cifar-100-binary/test.bin", data_dir);
    } else {
        for (int i = 0; i < 5; i++) {
            snprintf(paths[i], sizeof paths[i], "%s/cifar10/cifar-10-batches-bin/data_batch_%d.bin", data_dir, i + 1);
            p[i] = paths[i];
        }
        if (imageset_load_cifar(train, p, 5, 0, &le) != 0) return err_with_hint(e, &le, hint);
        snprintf(paths[0], sizeof paths[0], "%s/cifar10/cifar-10-batches-bin/test_batch.bin", data_dir);
    }
    p[0] = paths[0];
    if (imageset_load_cifar(test, p, 1, cifar100, &le) != 0) return err_with_hint(e, &le, hint);
    return 0;
}

int vit_data_from_sets(VitData *d, const char *name, ImageSet train, ImageSet test, int val_images, uint64_t seed,
                       int reference_norm, int augment, Err *e) {
    memset(d, 0, sizeof *d);
    d->name = name;
    d->train = train;
    d->test = test;
    d->augment = augment;
    if (val_images >= train.n)
        return err_set(e, "%s: %d validation images leave no training images of %d (hint: lower "
                          "CONFIG_VIT_VAL_IMAGES)", name, val_images, train.n);
    if (test.h != train.h || test.w != train.w || test.c != train.c || test.classes != train.classes)
        return err_set(e, "%s: test images (%dx%dx%d, %d classes) differ from the training images (%dx%dx%d, %d) "
                          "(hint: the files come from different data sets; delete the data set's folder under "
                          "CONFIG_DATA_DIR and fetch it again with scripts/get_data.sh)",
                       name, test.h, test.w, test.c, test.classes, train.h, train.w, train.c, train.classes);
    /* one seeded permutation: the last val_images are validation, never trained on */
    int *perm = xmalloc((size_t)train.n * sizeof(int));
    for (int i = 0; i < train.n; i++) perm[i] = i;
    Rng rng = rng_seeded(seed, 7);
    for (int i = train.n - 1; i > 0; i--) {
        int j = (int)rng_below(&rng, (uint64_t)i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    d->ntrain = train.n - val_images;
    d->nval = val_images;
    d->train_idx = perm;
    d->val_idx = perm + d->ntrain;
    if (reference_norm) { /* the paper's code: MNIST constants for MNIST and Fashion-MNIST */
        d->mean[0] = 0.1307;
        d->std[0] = 0.3081;
    } else { /* statistics of the training file; the test set is never looked at */
        imageset_channel_stats(&train, d->mean, d->std);
    }
    for (int ch = 0; ch < train.c; ch++)
        if (!(d->std[ch] > 0.0))
            return err_set(e, "%s: channel %d of the training images is constant (hint: the files are damaged; fetch "
                              "them again with scripts/get_data.sh)", name, ch);
    d->class_names = train.classes == 10 ? (strstr(name, "fashion") ? FMNIST_CLASSES
                                            : strstr(name, "cifar") ? CIFAR10_CLASSES
                                                                    : DIGITS)
                                         : NULL;
    return 0;
}

int vit_data_load(VitData *d, const char *data_dir, int val_images, uint64_t seed, Err *e) {
    ImageSet train = {0}, test = {0};
    const char *name;
    int rc;
    if (IS_ENABLED(CONFIG_VIT_DATA_MNIST)) {
        name = "mnist";
        rc = load_idx_pair(&train, data_dir, "mnist", "train", "scripts/get_data.sh mnist fetches MNIST", e);
        if (rc == 0) rc = load_idx_pair(&test, data_dir, "mnist", "t10k", "scripts/get_data.sh mnist fetches MNIST", e);
    } else if (IS_ENABLED(CONFIG_VIT_DATA_CIFAR10) || IS_ENABLED(CONFIG_VIT_DATA_CIFAR100)) {
        name = IS_ENABLED(CONFIG_VIT_DATA_CIFAR100) ? "cifar100" : "cifar10";
        rc = load_cifar(&train, &test, data_dir, IS_ENABLED(CONFIG_VIT_DATA_CIFAR100), e);
    } else if (IS_ENABLED(CONFIG_VIT_DATA_FMNIST)) {
        name = "fashion-mnist";
        const char *hint = "install Debian's dataset-fashion-mnist (make does it when run as root)";
        rc = load_idx_pair(&train, FMNIST_DIR, "", "train", hint, e);
        if (rc == 0) rc = load_idx_pair(&test, FMNIST_DIR, "", "t10k", hint, e);
    } else {
        return err_set(e, "no ViT data set in the configuration (hint: run make olddefconfig)");
    }
    if (rc != 0) {
        imageset_free(&train);
        imageset_free(&test);
        return rc;
    }
    rc = vit_data_from_sets(d, name, train, test, val_images, seed, IS_ENABLED(CONFIG_VIT_REFERENCE_NORM),
                            IS_ENABLED(CONFIG_VIT_AUGMENT), e);
    if (rc != 0) vit_data_free(d);
    return rc;
}

void vit_data_free(VitData *d) {
    imageset_free(&d->train);
    imageset_free(&d->test);
    free(d->train_idx);
    memset(d, 0, sizeof *d);
}

void vit_batch(const VitData *d, const ImageSet *set, const int *idx, int count, int P, int augment,
               uint64_t aug_seed, float *patches, int *labels) {
    size_t per = (size_t)(set->h / P) * (set->w / P) * P * P * set->c;
    for (int k = 0; k < count; k++) {
        int flip = 0, dy = 0, dx = 0;
        if (augment) { /* pad-4 random crop and a coin flip, from (seed, image) */
            Rng r = rng_seeded(aug_seed, (uint64_t)idx[k]);
            flip = (int)(rng_u64(&r) & 1);
            dy = (int)rng_below(&r, 9) - 4;
            dx = (int)rng_below(&r, 9) - 4;
        }
        imageset_patchify(set, idx[k], P, d->mean, d->std, flip, dy, dx, patches + (size_t)k * per);
        labels[k] = set->labels[idx[k]];
    }
}

char *vit_labels_json(const VitData *d) {
    int n = d->train.classes;
    size_t cap = 64 + (size_t)n * 32, len = 0;
    char *s = xmalloc(cap);
    len += (size_t)snprintf(s, cap, "{\"type\":\"classes\",\"size\":%d,\"names\":[", n);
    for (int k = 0; k < n; k++) {
        if (d->class_names)
            len += (size_t)snprintf(s + len, cap - len, "%s\"%s\"", k ? "," : "", d->class_names[k]);
        else
            len += (size_t)snprintf(s + len, cap - len, "%s\"%d\"", k ? "," : "", k);
    }
    snprintf(s + len, cap - len, "]}");
    return s;
}
