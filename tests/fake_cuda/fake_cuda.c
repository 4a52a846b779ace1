/*
 * A fake CUDA driver for the tests: built as libcuda.so.1, it answers the driver calls the
 * gpupool hook intercepts and records every call (one line each, appended to $FAKE_CUDA_LOG)
 * with the pid and, for cuInit, the CUDA_VISIBLE_DEVICES (and MPS limits) the process had then.
 *
 * Memory is bookkeeping only: addresses are made up, the device has $FAKE_CUDA_TOTAL_BYTES
 * (default 80 GiB), an allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY and freeing an
 * address it never gave fails with CUDA_ERROR_INVALID_VALUE, as a real driver's would. Every call except cuInit, cuDriverGetVersion and cuGetProcAddress fails with
 * CUDA_ERROR_NOT_INITIALIZED before cuInit succeeded.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define OK 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_INITIALIZED 3
#define NOT_FOUND 500

static int initialized;
static unsigned long long used;

/* Live allocations (address, bytes): few in any test, so a plain array searched from the end. */
struct live {
    unsigned long long key;
    unsigned long long bytes;
};
static struct live *live;
static size_t live_count, live_capacity;

static void keep(unsigned long long key, unsigned long long bytes) {
    if (live_count == live_capacity) {
        size_t capacity = live_capacity ? live_capacity * 2 : 64;
        struct live *grown = realloc(live, capacity * sizeof *grown);
        if (grown == NULL) return;
        live = grown;
        live_capacity = capacity;
    }
    live[live_count].key = key;
    live[live_count].bytes = bytes;
    live_count++;
}

static int drop(unsigned long long key) {
    for (size_t i = live_count; i-- > 0;)
        if (live[i].key == key) {
            used -= live[i].bytes;
            live[i] = live[--live_count];
            return 1;
        }
    return 0;
}
static unsigned long long next_address = 0x7f0000000000ULL;

static void record(const char *format, ...) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (path == NULL || *path == '\0') return;
    char line[1024];
    int n = snprintf(line, sizeof line, "pid=%ld ", (long)getpid());
    va_list args;
    va_start(args, format);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, format, args);
    va_end(args);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t ignored = write(fd, line, (size_t)n); /* one write: lines of processes never mix */
    (void)ignored;
    close(fd);
}

static unsigned long long total(void) {
    const char *text = getenv("FAKE_CUDA_TOTAL_BYTES");
    return text != NULL && *text ? strtoull(text, NULL, 10) : 80ULL << 30;
}

static CUresult allocate(const char *call, CUdeviceptr *dptr, unsigned long long bytes) {
    if (!initialized) {
        record("%s bytes=%llu result=%d", call, bytes, NOT_INITIALIZED);
        return NOT_INITIALIZED;
    }
    if (used + bytes > total()) {
        record("%s bytes=%llu result=%d", call, bytes, OUT_OF_MEMORY);
        return OUT_OF_MEMORY;
    }
    used += bytes;
    *dptr = next_address;
    keep(*dptr, bytes);
    next_address += (bytes + 0xfffff) & ~0xfffffULL;
    if (bytes == 0) next_address += 0x100000;
    record("%s bytes=%llu ptr=%llu result=0", call, bytes, *dptr);
    return OK;
}

/* An address it never handed out is CUDA_ERROR_INVALID_VALUE, as a real driver says. */
static CUresult release(const char *call, unsigned long long key) {
    CUresult result = !initialized ? NOT_INITIALIZED : drop(key) ? OK : INVALID_VALUE;
    record("%s ptr=%llu result=%d", call, key, result);
    return result;
}

CUresult cuInit(unsigned int flags) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    const char *threads = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    const char *memory = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    record("cuInit flags=%u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%s "
           "CUDA_VISIBLE_DEVICES=%s",
           flags, threads ? threads : "<unset>", memory ? memory : "<unset>",
           visible ? visible : "<unset>");
    initialized = 1;
    return OK;
}

CUresult cuDriverGetVersion(int *version) {
    *version = 12040;
    record("cuDriverGetVersion");
    return OK;
}

CUresult cuDeviceGetCount(int *count) {
    record("cuDeviceGetCount");
    if (!initialized) return NOT_INITIALIZED;
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    *count = visible != NULL && *visible ? 1 : 0;
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { return allocate("cuMemAlloc_v2", dptr, bytes); }
CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytes) { return allocate("cuMemAlloc", dptr, bytes); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned int element) {
    (void)element;
    *pitch = (width + 511) / 512 * 512;
    return allocate("cuMemAllocPitch_v2", dptr, (unsigned long long)*pitch * height);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    (void)flags;
    return allocate("cuMemAllocManaged", dptr, bytes);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, void *stream) {
    (void)stream;
    return allocate("cuMemAllocAsync", dptr, bytes);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, void *pool, void *stream) {
    (void)pool, (void)stream;
    return allocate("cuMemAllocFromPoolAsync", dptr, bytes);
}

CUresult cuMemCreate(unsigned long long *handle, size_t bytes, const void *prop,
                     unsigned long long flags) {
    (void)prop, (void)flags;
    return allocate("cuMemCreate", (CUdeviceptr *)handle, bytes);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) { return release("cuMemFree_v2", dptr); }
CUresult cuMemFree(CUdeviceptr dptr) { return release("cuMemFree", dptr); }
CUresult cuMemFreeAsync(CUdeviceptr dptr, void *stream) {
    (void)stream;
    return release("cuMemFreeAsync", dptr);
}
CUresult cuMemRelease(unsigned long long handle) { return release("cuMemRelease", handle); }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    record("cuMemGetInfo_v2");
    if (!initialized) return NOT_INITIALIZED;
    *total_bytes = (size_t)total();
    *free_bytes = (size_t)(total() - used);
    return OK;
}
CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) { return cuMemGetInfo_v2(free_bytes, total_bytes); }

struct entry {
    const char *name;
    void *function;
};

static const struct entry entries[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {NULL, NULL},
};

static CUresult lookup(const char *call, const char *symbol, void **pfn, int version) {
    record("%s symbol=%s version=%d", call, symbol, version);
    for (const struct entry *e = entries; e->name != NULL; e++)
        if (strcmp(e->name, symbol) == 0) {
            *pfn = e->function;
            return OK;
        }
    *pfn = NULL;
    return NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    (void)flags;
    return lookup("cuGetProcAddress", symbol, pfn, version);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
    (void)flags;
    CUresult result = lookup("cuGetProcAddress_v2", symbol, pfn, version);
    if (status != NULL) *status = result == OK ? 0 : 1;
    return result;
}
