/*
 * A CUDA driver client for the tests: it reaches the driver as real programs do, through
 * dlopen + dlsym ("dlsym") or, like the CUDA runtime since 11.3, through cuGetProcAddress_v2
 * ("procaddress"), then runs the steps it is given and prints one line per step:
 *
 *   init          cuInit(0)                     -> "cuInit 0"
 *   info          cuMemGetInfo_v2               -> "cuMemGetInfo 0 free=F total=T"
 *   alloc:N       cuMemAlloc_v2 of N bytes      -> "cuMemAlloc N 0" (or the error code)
 *   free          cuMemFree_v2 of the last successful allocation
 *   free-all      cuMemFree_v2 of every allocation not freed yet -> "cuMemFree-all N R"
 *                 (N frees, R the first error or 0)
 *   wait          read a line from stdin (the test decides when the process goes on)
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*proc_fn)(const char *, void **, int, unsigned long long, int *);

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s dlsym|procaddress STEP...\n", argv[0]);
        return 2;
    }
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    init_fn init;
    alloc_fn alloc;
    free_fn release;
    info_fn info;
    if (strcmp(argv[1], "procaddress") == 0) {
        proc_fn get = (proc_fn)dlsym(driver, "cuGetProcAddress_v2");
        int status = 0;
        if (get == NULL || get("cuInit", (void **)&init, 12000, 0, &status) != 0
            || get("cuMemAlloc", (void **)&alloc, 12000, 0, &status) != 0
            || get("cuMemFree", (void **)&release, 12000, 0, &status) != 0
            || get("cuMemGetInfo", (void **)&info, 12000, 0, &status) != 0) {
            fprintf(stderr, "cuGetProcAddress_v2 failed\n");
            return 3;
        }
    } else {
        init = (init_fn)dlsym(driver, "cuInit");
        alloc = (alloc_fn)dlsym(driver, "cuMemAlloc_v2");
        release = (free_fn)dlsym(driver, "cuMemFree_v2");
        info = (info_fn)dlsym(driver, "cuMemGetInfo_v2");
    }
    CUdeviceptr last = 0;
    CUdeviceptr *held = calloc((size_t)argc, sizeof *held);
    size_t held_count = 0;
    char line[256];
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "init") == 0) {
            printf("cuInit %d\n", init(0));
        } else if (strcmp(argv[i], "info") == 0) {
            size_t free_bytes = 0, total_bytes = 0;
            CUresult r = info(&free_bytes, &total_bytes);
            printf("cuMemGetInfo %d free=%zu total=%zu\n", r, free_bytes, total_bytes);
        } else if (strncmp(argv[i], "alloc:", 6) == 0) {
            size_t bytes = strtoull(argv[i] + 6, NULL, 10);
            CUdeviceptr ptr = 0;
            CUresult r = alloc(&ptr, bytes);
            if (r == 0) held[held_count++] = last = ptr;
            if (argc < 64) printf("cuMemAlloc %zu %d\n", bytes, r); /* long runs: summary only */
        } else if (strcmp(argv[i], "free") == 0) {
            for (size_t k = 0; k < held_count; k++)
                if (held[k] == last) held[k] = held[--held_count];
            printf("cuMemFree %d\n", release(last));
        } else if (strcmp(argv[i], "free-all") == 0) {
            CUresult first = 0;
            size_t n = held_count;
            while (held_count > 0) {
                CUresult r = release(held[--held_count]);
                if (first == 0) first = r;
            }
            printf("cuMemFree-all %zu %d\n", n, first);
        } else if (strcmp(argv[i], "wait") == 0) {
            printf("waiting\n");
            fflush(stdout);
            if (fgets(line, sizeof line, stdin) == NULL) break;
        } else {
            fprintf(stderr, "unknown step %s\n", argv[i]);
            return 2;
        }
        fflush(stdout);
    }
    return 0;
}
