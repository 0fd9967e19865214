/* The device-memory guard (CONFIG_CPU_DEVICE_GUARD, kernels/cpu/guard.c):
 * the backend's own calls reach dev_alloc buffers; host code that reads or
 * writes one directly dies of SIGSEGV with a line naming the buffer. Each
 * deliberate violation runs in a child process. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "kernels.h"
#include "test.h"

/* Runs fn in a child; returns its wait status and its stderr (first bytes). */
static int in_child(void (*fn)(float *), float *buf, char *err, size_t cap) {
    int fds[2];
    if (pipe(fds) != 0) FATAL("pipe failed");
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) FATAL("fork failed");
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn(buf);
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fds[0], err + n, cap - 1 - n)) > 0) n += (size_t)k;
    err[n] = 0;
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    return status;
}

static volatile float sink;
static void host_read(float *buf) { sink = buf[3]; }
static void host_write(float *buf) { buf[5] = 1.0f; }
static void through_backend(float *buf) {
    float host[8];
    dev_download(host, buf, sizeof host);
    sink = host[3];
}

int main(void) {
    backend_init(1);
    float *a = dev_alloc(8 * sizeof(float)), *b = dev_alloc(8 * sizeof(float)), *c = dev_alloc(8 * sizeof(float));
    float x[8], y[8];
    for (int i = 0; i < 8; i++) x[i] = (float)i, y[i] = 10.0f * (float)i;
    dev_upload(a, x, sizeof x);
    dev_upload(b, y, sizeof y);
    residual_forward(c, a, b, 8); /* a kernel reads and writes device memory */
    float z[8];
    dev_download(z, c, sizeof z);
    int ok = 1;
    for (int i = 0; i < 8; i++) ok &= z[i] == 11.0f * (float)i;
    CHECK(ok, "uploads, a kernel and a download see device memory");

    char err[4096];
    int st = in_child(host_read, a, err, sizeof err);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV && strstr(err, "host code touched device memory") &&
              strstr(err, "32-byte dev_alloc buffer"),
          "a host read of a device buffer is stopped and named (status %d): %.300s", st, err);
    st = in_child(host_write, b, err, sizeof err);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV && strstr(err, "host code touched device memory"),
          "a host write to a device buffer is stopped (status %d): %.300s", st, err);
    st = in_child(through_backend, a, err, sizeof err);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && !err[0], "the same read through dev_download is fine: %s", err);
    dev_free(a), dev_free(b), dev_free(c);
    return TEST_SUMMARY("test_guard");
}
