/* The loop bench/bench_cuda_hook.py times: N pairs of cuMemAlloc_v2 + cuMemFree_v2 through the
 * function pointers a program gets (dlsym on the dlopen'd driver, or cuGetProcAddress_v2),
 * after cuInit. Prints the best of ROUNDS rounds in nanoseconds per pair. */
#define _POSIX_C_SOURCE 199309L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*proc_fn)(const char *, void **, int, unsigned long long, int *);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    long pairs = argc > 2 ? atol(argv[2]) : 1000000;
    int rounds = argc > 3 ? atoi(argv[3]) : 5;
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) return 3;
    init_fn init;
    alloc_fn alloc;
    free_fn release;
    if (argc > 1 && strcmp(argv[1], "procaddress") == 0) {
        proc_fn get = (proc_fn)dlsym(driver, "cuGetProcAddress_v2");
        int status;
        get("cuInit", (void **)&init, 12000, 0, &status);
        get("cuMemAlloc", (void **)&alloc, 12000, 0, &status);
        get("cuMemFree", (void **)&release, 12000, 0, &status);
    } else {
        init = (init_fn)dlsym(driver, "cuInit");
        alloc = (alloc_fn)dlsym(driver, "cuMemAlloc_v2");
        release = (free_fn)dlsym(driver, "cuMemFree_v2");
    }
    if (init(0) != 0) {
        fprintf(stderr, "cuInit failed\n");
        return 4;
    }
    double best = 1e300;
    for (int r = 0; r < rounds; r++) {
        double start = now();
        for (long i = 0; i < pairs; i++) {
            CUdeviceptr p;
            if (alloc(&p, 1 << 20) != 0 || release(p) != 0) {
                fprintf(stderr, "allocation failed\n");
                return 5;
            }
        }
        double per = (now() - start) / pairs;
        if (per < best) best = per;
    }
    printf("%.1f\n", best);
    return 0;
}
