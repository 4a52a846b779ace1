/*
 * gpupool CUDA hook: loaded into a workload process with LD_PRELOAD (or /etc/ld.so.preload).
 *
 * On the process's first cuInit it asks the node-executor (Unix socket, one JSON line) for a
 * GPU, blocks until one is assigned while printing the waiting line, points
 * CUDA_VISIBLE_DEVICES at the assigned GPU's UUID and only then calls the real cuInit.
 * Device memory allocations are counted against the pod's limit (a counter shared by all the
 * pod's processes, in a memfd the executor passes) and refused with CUDA_ERROR_OUT_OF_MEMORY
 * once the pod would pass it; cuMemGetInfo reports the limit as the total.
 *
 * Entry points are reached three ways and all three are covered: the exported symbols
 * (programs linked against libcuda), dlsym on a dlopen'd libcuda (caught by our dlsym), and
 * cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime since 11.3).
 *
 * Fails closed: without an answer from the executor cuInit returns an error and prints one
 * line saying why; the real cuInit is never called then.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* Workload images carry their own glibc, often older than the one the hook is built with:
 * bind the few symbols that newer glibc versions anew to their oldest versions, so the hook
 * loads into any image with glibc >= 2.17 (a preload that fails to load is silently skipped
 * by the loader, which would let the process run without the hook). */
#if defined(__x86_64__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlvsym,dlvsym@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver dlopen,dlopen@GLIBC_2.17");
__asm__(".symver dlvsym,dlvsym@GLIBC_2.17");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.17");
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUmemoryPool;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_NOT_FOUND 500

#define DEFAULT_SOCKET "/run/gpupool/gpupool.sock"
#define DEFAULT_DRIVER "libcuda.so.1"
#define LINE_MAX_BYTES 4096

/* ------------------------------------------------------------------ the real functions */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_ptr;

static void *real_dlsym(void *handle, const char *name) {
    if (real_dlsym_ptr == NULL) {
        /* glibc >= 2.34 versions dlsym GLIBC_2.34; older x86_64 GLIBC_2.2.5, aarch64 GLIBC_2.17 */
        static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
        for (int i = 0; versions[i] != NULL && real_dlsym_ptr == NULL; i++)
            real_dlsym_ptr = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        if (real_dlsym_ptr == NULL) return NULL;
    }
    return real_dlsym_ptr(handle, name);
}

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static void *driver;

static void open_driver(void) {
    const char *path = getenv("GPUPOOL_REAL_LIBCUDA");
    driver = dlopen(path != NULL && *path ? path : DEFAULT_DRIVER, RTLD_NOW | RTLD_GLOBAL);
}

static void *real(const char *name) {
    pthread_once(&driver_once, open_driver);
    return driver == NULL ? NULL : real_dlsym(driver, name);
}

/* The driver's own function of the same name and signature, looked up once. */
#define REAL(name)                                                          \
    static __typeof__(&name) real_##name;                                   \
    if (real_##name == NULL) real_##name = (__typeof__(&name))real(#name);  \
    if (real_##name == NULL) return CUDA_ERROR_NOT_INITIALIZED

/* ------------------------------------------------------------------ messages */

static void say(const char *format, const char *a, const char *b) {
    fprintf(stderr, format, a, b);
    fflush(stderr);
}

/* ------------------------------------------------------------------ a minimal JSON reader
 * The executor's lines are flat objects written by msgspec: "key":value with no spaces. */

static const char *field(const char *line, const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(line, pattern);
    return at == NULL ? NULL : at + strlen(pattern);
}

static long long number_field(const char *line, const char *key, long long otherwise) {
    const char *at = field(line, key);
    if (at == NULL) return otherwise;
    char *end;
    long long value = strtoll(at, &end, 10);
    return end == at ? otherwise : value;
}

/* Copies a JSON string value (\" \\ \/ and \uXXXX below 0x80 unescaped, others as '?'). */
static int string_field(const char *line, const char *key, char *out, size_t size) {
    const char *at = field(line, key);
    if (at == NULL || *at != '"' || size == 0) return -1;
    size_t n = 0;
    for (at++; *at && *at != '"'; at++) {
        char c = *at;
        if (c == '\\') {
            at++;
            if (*at == 'u') {
                unsigned code = 0;
                if (sscanf(at + 1, "%4x", &code) != 1) return -1;
                c = code < 0x80 ? (char)code : '?';
                at += 4;
            } else if (*at == 'n') {
                c = '\n';
            } else if (*at == 't') {
                c = '\t';
            } else if (*at == '\0') {
                return -1;
            } else {
                c = *at;
            }
        }
        if (n + 1 >= size) return -1;
        out[n++] = c;
    }
    if (*at != '"') return -1;
    out[n] = '\0';
    return 0;
}

/* Kubernetes names and namespaces: lower-case letters, digits, '-', '.'. Anything else is
 * refused rather than escaped. */
static int plain_name(const char *s) {
    if (s == NULL || *s == '\0' || strlen(s) > 253) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '-' || *s == '.'))
            return 0;
    return 1;
}

/* ------------------------------------------------------------------ the memory counter */

struct pod_memory {
    unsigned long long used; /* bytes the pod's processes hold on its GPU, through hooks */
};

static struct pod_memory *pod_memory;  /* shared by the pod's processes (memfd from the executor) */
static struct pod_memory own_memory;   /* when no memfd came: this process alone */
static unsigned long long memory_limit; /* 0: no limit known */

static int reserve(unsigned long long bytes) {
    if (memory_limit == 0) return 1;
    unsigned long long now = __atomic_add_fetch(&pod_memory->used, bytes, __ATOMIC_SEQ_CST);
    if (now > memory_limit || now < bytes) {
        __atomic_sub_fetch(&pod_memory->used, bytes, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

static void unreserve(unsigned long long bytes) {
    if (memory_limit != 0 && bytes != 0)
        __atomic_sub_fetch(&pod_memory->used, bytes, __ATOMIC_SEQ_CST);
}

/* Sizes of live allocations by address (or handle): open addressing, grown when half full. */
struct slot {
    unsigned long long key;
    unsigned long long bytes;
};
static struct slot *slots;
static size_t slot_count;
static size_t slot_used;
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;
#define TOMBSTONE 1ULL /* no allocation has address 1 */

/* Device addresses are aligned (low bits all zero): mix every bit into the slot number. */
static size_t home(unsigned long long key, size_t count) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (size_t)key & (count - 1);
}

static size_t slot_of(struct slot *table, size_t count, unsigned long long key) {
    size_t i = home(key, count);
    while (table[i].key != 0 && table[i].key != key) i = (i + 1) & (count - 1);
    return i;
}

static void remember(unsigned long long key, unsigned long long bytes) {
    if (memory_limit == 0 || key == 0) return;
    pthread_mutex_lock(&slots_lock);
    if ((slot_used + 1) * 2 > slot_count) { /* rebuilt without tombstones, 4x the live ones */
        size_t live = 0;
        for (size_t i = 0; i < slot_count; i++)
            if (slots[i].key > TOMBSTONE) live++;
        size_t count = 1024;
        while (count < (live + 1) * 4) count *= 2;
        struct slot *table = calloc(count, sizeof *table);
        if (table != NULL) {
            for (size_t i = 0; i < slot_count; i++)
                if (slots[i].key > TOMBSTONE) table[slot_of(table, count, slots[i].key)] = slots[i];
            free(slots);
            slots = table;
            slot_count = count;
            slot_used = live;
        }
    }
    if (slots != NULL && slot_used < slot_count) { /* full only if a rebuild failed */
        size_t i = slot_of(slots, slot_count, key);
        if (slots[i].key == 0) slot_used++;
        slots[i].key = key;
        slots[i].bytes = bytes;
    }
    pthread_mutex_unlock(&slots_lock);
}

static unsigned long long forget(unsigned long long key) {
    unsigned long long bytes = 0;
    if (memory_limit == 0 || key == 0) return 0;
    pthread_mutex_lock(&slots_lock);
    if (slots != NULL) {
        size_t i = home(key, slot_count);
        while (slots[i].key != 0) {
            if (slots[i].key == key) {
                bytes = slots[i].bytes;
                slots[i].key = TOMBSTONE;
                break;
            }
            i = (i + 1) & (slot_count - 1);
        }
    }
    pthread_mutex_unlock(&slots_lock);
    return bytes;
}

/* ------------------------------------------------------------------ asking for a GPU */

static pthread_once_t gate_once = PTHREAD_ONCE_INIT;
static CUresult gate_result = CUDA_ERROR_NO_DEVICE;

static int connect_executor(const char *path) {
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof address.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(address.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&address, sizeof address) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* Reads one line (without its newline) into buf; a passed fd, if any, into *passed_fd. */
struct reader {
    int fd;
    char data[LINE_MAX_BYTES];
    size_t length;
};

static int read_line(struct reader *r, char *line, size_t size, int *passed_fd) {
    for (;;) {
        char *newline = memchr(r->data, '\n', r->length);
        if (newline != NULL) {
            size_t n = (size_t)(newline - r->data);
            if (n >= size) return -1;
            memcpy(line, r->data, n);
            line[n] = '\0';
            r->length -= n + 1;
            memmove(r->data, newline + 1, r->length);
            return 0;
        }
        if (r->length == sizeof r->data) return -1;
        char control[CMSG_SPACE(sizeof(int) * 4)];
        struct iovec io = {.iov_base = r->data + r->length, .iov_len = sizeof r->data - r->length};
        struct msghdr message = {
            .msg_iov = &io, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
        ssize_t got = recvmsg(r->fd, &message, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c != NULL; c = CMSG_NXTHDR(&message, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int *list = (int *)CMSG_DATA(c);
            for (size_t i = 0; i < fds; i++) {
                if (passed_fd != NULL && *passed_fd < 0)
                    *passed_fd = list[i];
                else
                    close(list[i]);
            }
        }
        r->length += (size_t)got;
    }
}

static int write_all(int fd, const char *data, size_t length) {
    while (length > 0) {
        ssize_t sent = send(fd, data, length, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) continue;
        if (sent <= 0) return -1;
        data += sent;
        length -= (size_t)sent;
    }
    return 0;
}

/* An MPS control daemon serves this process: its pipe directory is set or at the default. */
static int mps_daemon_present(void) {
    const char *pipes = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (pipes != NULL && *pipes != '\0') return access(pipes, F_OK) == 0;
    return access("/tmp/nvidia-mps", F_OK) == 0;
}

static void ask_for_gpu(void) {
    const char *path = getenv("GPUPOOL_SOCKET");
    if (path == NULL || *path == '\0') path = DEFAULT_SOCKET;
    const char *ns = getenv("GPUPOOL_POD_NAMESPACE");
    const char *name = getenv("GPUPOOL_POD_NAME");
    char request[1024];
    if (ns != NULL || name != NULL) {
        if (!plain_name(ns) || !plain_name(name)) {
            say("gpupool: GPUPOOL_POD_NAMESPACE/GPUPOOL_POD_NAME (%s/%s) are not Kubernetes "
                "names; no GPU is used\n", ns ? ns : "", name ? name : "");
            return;
        }
        snprintf(request, sizeof request,
                 "{\"type\":\"AttachRequest\",\"pid\":%ld,\"pod\":{\"namespace\":\"%s\",\"name\":\"%s\"}}\n",
                 (long)getpid(), ns, name);
    } else {
        snprintf(request, sizeof request, "{\"type\":\"AttachRequest\",\"pid\":%ld}\n", (long)getpid());
    }
    int fd = connect_executor(path);
    if (fd < 0) {
        say("gpupool: cannot reach the node-executor at %s (%s); this process gets no GPU\n", path,
            strerror(errno));
        return;
    }
    if (write_all(fd, request, strlen(request)) != 0) {
        say("gpupool: the node-executor at %s closed the connection (%s); this process gets no GPU\n",
            path, strerror(errno));
        close(fd);
        return;
    }
    static struct reader r;
    r.fd = fd;
    r.length = 0;
    char line[LINE_MAX_BYTES];
    for (;;) {
        int memory_fd = -1;
        if (read_line(&r, line, sizeof line, &memory_fd) != 0) {
            if (memory_fd >= 0) close(memory_fd);
            say("gpupool: the node-executor at %s went away before assigning a GPU%s; this "
                "process gets no GPU\n", path, "");
            break;
        }
        char type[32] = "";
        string_field(line, "type", type, sizeof type);
        if (strcmp(type, "Waiting") == 0) {
            if (memory_fd >= 0) close(memory_fd);
            fprintf(stderr, "You have been waiting for %lld seconds. Approximate position: %lld\n",
                    number_field(line, "seconds", 0), number_field(line, "position", 0));
            fflush(stderr);
            continue;
        }
        if (strcmp(type, "Granted") == 0) {
            char uuid[256], mps_memory[128];
            if (string_field(line, "gpu_uuid", uuid, sizeof uuid) != 0 || uuid[0] == '\0') {
                if (memory_fd >= 0) close(memory_fd);
                say("gpupool: the node-executor's assignment names no GPU (%s)%s; this process "
                    "gets no GPU\n", line, "");
                break;
            }
            long long limit = number_field(line, "memory_limit_bytes", 0);
            long long core = number_field(line, "core_percentage", 0);
            setenv("CUDA_VISIBLE_DEVICES", uuid, 1);
            setenv("GPUPOOL_GPU_UUID", uuid, 1);
            if (mps_daemon_present()
                && string_field(line, "mps_pinned_device_mem_limit", mps_memory, sizeof mps_memory) == 0
                && mps_memory[0] != '\0') {
                char text[32];
                snprintf(text, sizeof text, "%lld", core);
                setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", text, 1);
                setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", mps_memory, 1);
            }
            pod_memory = &own_memory;
            if (memory_fd >= 0) {
                void *shared = mmap(NULL, sizeof(struct pod_memory), PROT_READ | PROT_WRITE,
                                    MAP_SHARED, memory_fd, 0);
                close(memory_fd);
                if (shared != MAP_FAILED) pod_memory = shared;
            }
            memory_limit = limit > 0 ? (unsigned long long)limit : 0;
            gate_result = CUDA_SUCCESS;
            break;
        }
        if (memory_fd >= 0) close(memory_fd);
        if (strcmp(type, "Rejected") == 0) {
            char reason[256] = "", text[2048] = "";
            string_field(line, "reason", reason, sizeof reason);
            string_field(line, "message", text, sizeof text);
            fprintf(stderr, "gpupool: the node-executor refused this process a GPU (%s): %s\n",
                    reason, text);
            fflush(stderr);
            break;
        }
        if (strcmp(type, "Exited") == 0 || strcmp(type, "Preempted") == 0) {
            say("gpupool: the pod left the queue before a GPU was assigned (%s)%s; this process "
                "gets no GPU\n", type, "");
            break;
        }
        /* an unknown message: ignore it (newer executors may say more) */
    }
    /* The connection stays open while the process lives: the executor tracks the process by
     * pidfd, and a hang-up while waiting means "no longer wanted". */
    if (gate_result != CUDA_SUCCESS) close(fd);
}

static CUresult gate(void) {
    pthread_once(&gate_once, ask_for_gpu);
    return gate_result;
}

/* ------------------------------------------------------------------ intercepted entry points */

CUresult cuInit(unsigned int flags) {
    CUresult granted = gate();
    if (granted != CUDA_SUCCESS) return granted;
    REAL(cuInit);
    return real_cuInit(flags);
}

#define ALLOC_BODY(call, key, bytes)                    \
    if (gate_result != CUDA_SUCCESS) return CUDA_ERROR_NOT_INITIALIZED; \
    if (!reserve(bytes)) return CUDA_ERROR_OUT_OF_MEMORY; \
    CUresult result = call;                             \
    if (result == CUDA_SUCCESS)                         \
        remember(key, bytes);                           \
    else                                                \
        unreserve(bytes);                               \
    return result

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    REAL(cuMemAlloc_v2);
    ALLOC_BODY(real_cuMemAlloc_v2(dptr, bytesize), *dptr, bytesize);
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) { return cuMemAlloc_v2(dptr, bytesize); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned int element) {
    REAL(cuMemAllocPitch_v2);
    /* the pitch is only known afterwards: reserve the worst case (pitch <= width rounded up to
     * 512), then settle to the real size */
    unsigned long long worst = (unsigned long long)((width + 511) / 512 * 512) * height;
    if (gate_result != CUDA_SUCCESS) return CUDA_ERROR_NOT_INITIALIZED;
    if (!reserve(worst)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult result = real_cuMemAllocPitch_v2(dptr, pitch, width, height, element);
    if (result != CUDA_SUCCESS) {
        unreserve(worst);
        return result;
    }
    unsigned long long bytes = (unsigned long long)*pitch * height;
    if (bytes > worst) {
        if (!reserve(bytes - worst)) { /* never expected: give it back and refuse */
            unreserve(worst);
            CUresult (*free_v2)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))real("cuMemFree_v2");
            if (free_v2 != NULL) free_v2(*dptr);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else {
        unreserve(worst - bytes);
    }
    remember(*dptr, bytes);
    return result;
}

CUresult cuMemAllocPitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                         unsigned int element) {
    return cuMemAllocPitch_v2(dptr, pitch, width, height, element);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    REAL(cuMemAllocManaged);
    ALLOC_BODY(real_cuMemAllocManaged(dptr, bytesize, flags), *dptr, bytesize);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    REAL(cuMemAllocAsync);
    ALLOC_BODY(real_cuMemAllocAsync(dptr, bytesize, stream), *dptr, bytesize);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream stream) {
    REAL(cuMemAllocFromPoolAsync);
    ALLOC_BODY(real_cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream), *dptr, bytesize);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop,
                     unsigned long long flags) {
    REAL(cuMemCreate);
    ALLOC_BODY(real_cuMemCreate(handle, size, prop, flags), *handle, size);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    REAL(cuMemFree_v2);
    CUresult result = real_cuMemFree_v2(dptr);
    if (result == CUDA_SUCCESS) unreserve(forget(dptr));
    return result;
}

CUresult cuMemFree(CUdeviceptr dptr) { return cuMemFree_v2(dptr); }

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    REAL(cuMemFreeAsync);
    CUresult result = real_cuMemFreeAsync(dptr, stream);
    if (result == CUDA_SUCCESS) unreserve(forget(dptr));
    return result;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    REAL(cuMemRelease);
    CUresult result = real_cuMemRelease(handle);
    if (result == CUDA_SUCCESS) unreserve(forget(handle));
    return result;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    REAL(cuMemGetInfo_v2);
    CUresult result = real_cuMemGetInfo_v2(free_bytes, total_bytes);
    if (result != CUDA_SUCCESS || memory_limit == 0) return result;
    unsigned long long used = __atomic_load_n(&pod_memory->used, __ATOMIC_SEQ_CST);
    unsigned long long left = used >= memory_limit ? 0 : memory_limit - used;
    if (total_bytes != NULL && *total_bytes > memory_limit) *total_bytes = (size_t)memory_limit;
    if (free_bytes != NULL && *free_bytes > left) *free_bytes = (size_t)left;
    return result;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    return cuMemGetInfo_v2(free_bytes, total_bytes);
}

/* ------------------------------------------------------------------ how programs find them */

struct replacement {
    const char *name;
    void *function;
};

static const struct replacement replacements[];
static void *replacement_for(const char *name);


CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    REAL(cuGetProcAddress);
    CUresult result = real_cuGetProcAddress(symbol, pfn, version, flags);
    void *ours = result == CUDA_SUCCESS && symbol != NULL ? replacement_for(symbol) : NULL;
    if (ours != NULL && pfn != NULL) *pfn = ours;
    return result;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             void *status) {
    REAL(cuGetProcAddress_v2);
    CUresult result = real_cuGetProcAddress_v2(symbol, pfn, version, flags, status);
    void *ours = result == CUDA_SUCCESS && symbol != NULL ? replacement_for(symbol) : NULL;
    if (ours != NULL && pfn != NULL) *pfn = ours;
    return result;
}

/* Names as cuGetProcAddress is asked for them (no _v2 suffix) and as dlsym is. The memory
 * calls map to their _v2 forms, which every CUDA since 3.2 uses. */
static const struct replacement replacements[] = {
    {"cuInit", (void *)cuInit},
    {"cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemAlloc_v2", (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2},
    {"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemFree_v2", (void *)cuMemFree_v2},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuMemGetInfo_v2", (void *)cuMemGetInfo_v2},
    {NULL, NULL},
};

static void *replacement_for(const char *name) {
    if (name[0] != 'c' || name[1] != 'u') return NULL;
    for (const struct replacement *r = replacements; r->name != NULL; r++)
        if (strcmp(r->name, name) == 0) return r->function;
    return NULL;
}

/* A program that dlopens libcuda and looks the entry points up gets ours; a lookup that is
 * not for libcuda (RTLD_NEXT from another interposer, other libraries) is untouched. */
void *dlsym(void *handle, const char *name) {
    void *found = real_dlsym(handle, name);
    if (found == NULL || handle == RTLD_NEXT) return found;
    void *ours = replacement_for(name);
    return ours != NULL ? ours : found;
}
