/*
 * nvImageCodec's device and pinned allocators (nvimgcodecDeviceAllocator_t, nvimgcodecPinnedAllocator_t)
 * backed by a CUDA stream-ordered memory pool, for threadloader's C API binding (_allocators.py).
 *
 * Why C: nvImageCodec calls its allocators from its own worker threads. A Python callback there would
 * take the GIL on every allocation, beside a training loop that wants it, and deadlocks where the
 * caller waits on those threads while holding it. These functions only forward to CUDA's runtime,
 * whose entry points Python looks up in the libcudart that torch loaded and hands over in a
 * tl_context: nothing here links against CUDA, Python or even libc, so one build serves every Python
 * and CUDA version.
 *
 * Why a pool: with allocators of its own, nvImageCodec pads and preallocates nvJPEG's device buffers
 * as DALI has it do; and cudaFreeAsync returns memory to the pool in stream order, where the default
 * cudaFree waits for the whole GPU, a training step's queued kernels included.
 *
 * The structs live here, in static storage, because nvImageCodec keeps pointers to the allocators for
 * as long as a Decoder lives, possibly past the Python objects that asked for them.
 */
#include <stddef.h>

#define TL_MAX_DEVICES 64

typedef int (*tl_pool_malloc)(void **ptr, size_t size, void *pool, void *stream); /* cudaMallocFromPoolAsync */
typedef int (*tl_stream_free)(void *ptr, void *stream);                            /* cudaFreeAsync */
typedef int (*tl_host_malloc)(void **ptr, size_t size, unsigned int flags);        /* cudaHostAlloc */
typedef int (*tl_host_free)(void *ptr);                                            /* cudaFreeHost */

typedef struct {
    tl_pool_malloc pool_malloc;
    tl_stream_free stream_free;
    tl_host_malloc host_malloc;
    tl_host_free host_free;
    void *pool; /* a cudaMemPool_t of the device */
} tl_context;

/* nvimgcodecDeviceAllocator_t and nvimgcodecPinnedAllocator_t of nvimgcodec.h (0.9): the same layout. */
typedef struct {
    int struct_type;
    size_t struct_size;
    void *struct_next;
    int (*malloc)(void *ctx, void **ptr, size_t size, void *stream);
    int (*free)(void *ctx, void *ptr, size_t size, void *stream);
    void *ctx;
    size_t padding;
} tl_allocator;

/* Calls made, for tests and benchmarks (tl_counts): device mallocs, device frees, pinned mallocs,
 * pinned frees, NULL frees left out. Relaxed atomics: counts, not synchronization. */
static unsigned long long counts[4];

static tl_context contexts[TL_MAX_DEVICES];
static tl_allocator device_allocators[TL_MAX_DEVICES];
static tl_allocator pinned_allocators[TL_MAX_DEVICES];

static int device_malloc(void *ctx, void **ptr, size_t size, void *stream) {
    tl_context *cuda = ctx;
    __atomic_fetch_add(&counts[0], 1, __ATOMIC_RELAXED);
    return cuda->pool_malloc(ptr, size, cuda->pool, stream);
}

static int device_free(void *ctx, void *ptr, size_t size, void *stream) {
    (void)size;
    if (!ptr) {
        return 0;
    }
    __atomic_fetch_add(&counts[1], 1, __ATOMIC_RELAXED);
    return ((tl_context *)ctx)->stream_free(ptr, stream);
}

/* Pinned memory is freed with cudaFreeHost, which waits for the GPU as nvImageCodec's default does:
 * its buffers grow rarely once padded (nvjpeg_cuda_decoder:host_memory_padding). */
static int pinned_malloc(void *ctx, void **ptr, size_t size, void *stream) {
    (void)stream;
    __atomic_fetch_add(&counts[2], 1, __ATOMIC_RELAXED);
    return ((tl_context *)ctx)->host_malloc(ptr, size, 0);
}

static int pinned_free(void *ctx, void *ptr, size_t size, void *stream) {
    (void)size;
    (void)stream;
    if (!ptr) {
        return 0;
    }
    __atomic_fetch_add(&counts[3], 1, __ATOMIC_RELAXED);
    return ((tl_context *)ctx)->host_free(ptr);
}

/* Sets up a device's allocators over `cuda` (copied), with nvImageCodec's struct type codes and
 * paddings, and returns their addresses; -1 for a device index out of range. Not for a device whose
 * Decoders are in use: the caller sets each device up once. */
int tl_setup(int device, const tl_context *cuda, int device_type, int pinned_type, size_t device_padding,
             size_t pinned_padding, tl_allocator **device_out, tl_allocator **pinned_out) {
    if (device < 0 || device >= TL_MAX_DEVICES) {
        return -1;
    }
    contexts[device] = *cuda;
    device_allocators[device] = (tl_allocator){device_type, sizeof(tl_allocator), NULL, device_malloc,
                                               device_free, &contexts[device], device_padding};
    pinned_allocators[device] = (tl_allocator){pinned_type, sizeof(tl_allocator), NULL, pinned_malloc,
                                               pinned_free, &contexts[device], pinned_padding};
    *device_out = &device_allocators[device];
    *pinned_out = &pinned_allocators[device];
    return 0;
}

/* The calls made so far, all devices together, into out[4] (see counts). */
void tl_counts(unsigned long long *out) {
    for (int i = 0; i < 4; i++) {
        out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
    }
}
