/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, for the tests and the host
 * benchmark: every call succeeds, modules and functions are counters, and each launch (cuLaunchKernel
 * or cuLaunchKernelEx) is recorded while recording is on: the function, grid, block, shared memory,
 * stream and each parameter's bytes (the sizes registered per function with fake_set_param_sizes;
 * 8 bytes each otherwise). Built with the soname libcuda.so.1 and loaded RTLD_GLOBAL before anything
 * dlopens the driver, so that Triton's launcher and addnorm's native call both reach it. */
#include <stdint.h>
#include <string.h>
#include "cuda.h"

#define MAX_FUNCS 256
#define MAX_LAUNCHES 64
#define MAX_PARAMS 48
#define MAX_BYTES 8

typedef struct {
  uint64_t function, stream;
  unsigned grid[3], block[3], smem;
  int n_params;
  int sizes[MAX_PARAMS];
  unsigned char bytes[MAX_PARAMS][MAX_BYTES];
  int ex; /* 1: cuLaunchKernelEx */
} Launch;

static char names[MAX_FUNCS][128];
static int n_sizes[MAX_FUNCS];
static int sizes[MAX_FUNCS][MAX_PARAMS];
static uint64_t n_funcs = 0, n_modules = 0;
static Launch launches[MAX_LAUNCHES];
static int n_launches = 0, recording = 0;
static long long count = 0;

void fake_set_recording(int on) {
  if (on) n_launches = 0;
  recording = on;
}
long long fake_launch_count(void) { return count; }
int fake_n_launches(void) { return n_launches; }
const Launch *fake_launch(int i) { return (i >= 0 && i < n_launches) ? &launches[i] : 0; }
int fake_launch_struct_size(void) { return (int)sizeof(Launch); }
const char *fake_function_name(uint64_t f) { return (f && f <= n_funcs) ? names[f - 1] : ""; }
void fake_set_param_sizes(uint64_t f, int n, const int *s) {
  if (!f || f > n_funcs || n > MAX_PARAMS) return;
  n_sizes[f - 1] = n;
  memcpy(sizes[f - 1], s, n * sizeof(int));
}

static CUresult record(uint64_t f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned smem, CUstream stream, void **params, int ex) {
  count++;
  if (!recording || n_launches >= MAX_LAUNCHES) return CUDA_SUCCESS;
  Launch *l = &launches[n_launches++];
  memset(l, 0, sizeof(*l));
  l->function = f; l->stream = (uint64_t)(uintptr_t)stream; l->ex = ex;
  l->grid[0] = gx; l->grid[1] = gy; l->grid[2] = gz;
  l->block[0] = bx; l->block[1] = by; l->block[2] = bz; l->smem = smem;
  int n = (f && f <= n_funcs) ? n_sizes[f - 1] : 0;
  l->n_params = n;
  for (int i = 0; i < n; i++) {
    int sz = sizes[f - 1][i];
    l->sizes[i] = sz;
    memcpy(l->bytes[i], params[i], sz > MAX_BYTES ? MAX_BYTES : sz);
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, unsigned smem, CUstream stream, void **params,
                                void **extra) {
  (void)extra;
  return record((uint64_t)(uintptr_t)f, gx, gy, gz, bx, by, bz, smem, stream, params, 0);
}
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  (void)extra;
  return record((uint64_t)(uintptr_t)f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                c->blockDimZ, c->sharedMemBytes, c->hStream, params, 1);
}
#undef cuLaunchKernelEx
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra);

CUresult CUDAAPI cuInit(unsigned flags) { (void)flags; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = 12080; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int i) { *d = i; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)(uintptr_t)1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetDevice(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetLimit(size_t *v, CUlimit l) { (void)l; *v = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetLimit(CUlimit l, size_t v) { (void)l; (void)v; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  (void)d; *c = (CUcontext)(uintptr_t)1; return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    default: *v = 232448; /* shared memory sizes, clock rates: any positive value */
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleLoadData(CUmodule *m, const void *image) {
  (void)image; *m = (CUmodule)(uintptr_t)(++n_modules); return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleUnload(CUmodule m) { (void)m; return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  (void)m;
  if (n_funcs < MAX_FUNCS) {
    strncpy(names[n_funcs], name, 127);
    n_funcs++;
  }
  *f = (CUfunction)(uintptr_t)n_funcs;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f) {
  (void)f;
  *v = a == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  (void)f; (void)a; (void)v; return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c) { (void)f; (void)c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake driver"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) {
  (void)a; *(CUdeviceptr *)data = p; return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) {
  (void)s; *st = CU_STREAM_CAPTURE_STATUS_NONE; return CUDA_SUCCESS;
}
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) {
  (void)f; (void)c; *n = 1; return CUDA_SUCCESS;
}
