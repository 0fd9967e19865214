/* Minimal test harness: every CHECK counts as one assertion; a test binary
 * ends with TEST_SUMMARY() which prints "# <name>: N passed, M failed" (the
 * runner adds these up) and returns non-zero when anything failed. */
#ifndef KVLAB_TEST_H
#define KVLAB_TEST_H

#include <math.h>
#include <stdio.h>
#include <string.h>

static int test_passed_, test_failed_;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) {                                                             \
            test_passed_++;                                                     \
        } else {                                                                \
            test_failed_++;                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                         \
            printf(__VA_ARGS__);                                                \
            printf("\n");                                                       \
        }                                                                       \
    } while (0)

/* |a-b| <= atol + rtol*|b| */
#define CHECK_CLOSE(a, b, atol, rtol, ...)                                      \
    do {                                                                        \
        double a_ = (double)(a), b_ = (double)(b);                              \
        int ok_ = fabs(a_ - b_) <= (atol) + (rtol)*fabs(b_);                    \
        if (!ok_) printf("  got %.9g expected %.9g\n", a_, b_);                 \
        CHECK(ok_, __VA_ARGS__);                                                \
    } while (0)

#define TEST_SUMMARY(name)                                                      \
    (printf("# %s: %d passed, %d failed\n", (name), test_passed_, test_failed_), \
     test_failed_ ? 1 : 0)

#endif
