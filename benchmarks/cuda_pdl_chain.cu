// A chain of L dependent one-row products in hand-written CUDA, called as one XLA FFI
// custom call: y = W[L-1] (... (W[1] (W[0] x))), x and y float32, each W[l] bf16 stored
// [out, in] (a row of it is contiguous), of any shapes (see Chain).
//
// One kernel a product. A warp owns ROWS output rows: it loads their first bf16 weights
// into registers first, then (with `pdl`) lets the next kernel launch
// (`griddepcontrol.launch_dependents`) and waits for the previous one
// (`griddepcontrol.wait`), and only then reads the previous kernel's output, so a kernel's
// weight reads can overlap its predecessor. Without `pdl` the kernels run one after the
// other as usual. The kernels are launched with programmatic stream serialization when
// `pdl` is set. Products of 2048 inputs and many rows use a persistent kernel
// (matvec_stream).
//
// Benchmark code (benchmarks/cuda_pdl_chain.py builds it with nvcc); not part of jspec.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int WARPS = 8;
constexpr int ROWS = 2;                   // output rows a warp computes
constexpr int BLOCK_ROWS = WARPS * ROWS;  // output rows a block computes

// acc += the 8 bf16 weights of piece . the 8 inputs xs.
__device__ __forceinline__ float dot8(const uint4& piece, const float* xs, float acc) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&piece);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(p[j]);
    acc = fmaf(f.x, xs[2 * j], acc);
    acc = fmaf(f.y, xs[2 * j + 1], acc);
  }
  return acc;
}

// xs = src[0..8) (16-byte aligned).
__device__ __forceinline__ void load8(const float* src, float* xs) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  xs[0] = a.x; xs[1] = a.y; xs[2] = a.z; xs[3] = a.w; xs[4] = b.x; xs[5] = b.y; xs[6] = b.z; xs[7] = b.w;
}

// Sums each row's lane partials over the warp; lane 0 writes y[row0 + r].
__device__ __forceinline__ void store_rows(float (&acc)[ROWS], float* y, int64_t row0, int lane) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    if (lane == 0) y[row0 + r] = acc[r];
  }
}

// y[n] = sum_k w[n, k] x[k] for n < N (w [N, k] bf16, rows contiguous), x read as zero at
// k >= xk. A warp owns ROWS rows and walks k in steps of CH * 256 inputs, loading the next
// step's weights before it multiplies the current one's; the first step's weights are
// loaded before the wait. ONE: k is exactly CH * 256 (one step, no bounds checks).
template <int CH, bool ONE>
__global__ void __launch_bounds__(WARPS * 32) matvec(const float* x, int xk, const __nv_bfloat16* __restrict__ w,
                                                     float* y, int k, int pdl) {
  constexpr int STEP = CH * 32 * 8;  // inputs a step covers
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.x) * BLOCK_ROWS + warp * ROWS;
  const int pieces = k / 8;
  const uint4* rows = reinterpret_cast<const uint4*>(w + row0 * k);
  auto load = [&](uint4 (&buf)[ROWS][CH], int base) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int p = base / 8 + c * 32 + lane;
        buf[r][c] = ONE || p < pieces ? __ldg(rows + int64_t(r) * pieces + p) : make_uint4(0, 0, 0, 0);
      }
  };
  extern __shared__ float xsm[];  // the general case's input, staged once a block (k floats)
  float acc[ROWS] = {};
  auto multiply = [&](const uint4 (&buf)[ROWS][CH], int base) {
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int kk = base + (c * 32 + lane) * 8;
      float xs[8];
      if (ONE) {
        if (xk == STEP || kk + 8 <= xk) {
          load8(x + kk, xs);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xs[j] = kk + j < xk ? x[kk + j] : 0.0f;
        }
      } else if (kk < k) {
        load8(xsm + kk, xs);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) xs[j] = 0.0f;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = dot8(buf[r][c], xs, acc[r]);
    }
  };
  uint4 even[ROWS][CH];
  load(even, 0);
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (ONE) {
    multiply(even, 0);
  } else {
    for (int i = threadIdx.x; i < k; i += blockDim.x) xsm[i] = i < xk ? x[i] : 0.0f;
    __syncthreads();
    uint4 odd[ROWS][CH];
    for (int base = 0; base < k; base += 2 * STEP) {
      if (base + STEP < k) load(odd, base + STEP);
      multiply(even, base);
      if (base + STEP < k) {
        if (base + 2 * STEP < k) load(even, base + 2 * STEP);
        multiply(odd, base + STEP);
      }
    }
  }
  store_rows(acc, y, row0, lane);
}

// The same product for many rows and k = CH * 256: a persistent kernel. Each block keeps
// its lanes' inputs in registers and walks row groups gridDim.x apart, loading the next
// group's weights before it multiplies the current one's.
template <int CH>
__global__ void __launch_bounds__(WARPS * 32, 1) matvec_stream(const float* x, int xk,
                                                               const __nv_bfloat16* __restrict__ w, float* y, int k,
                                                               int n, int pdl) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = n / BLOCK_ROWS;
  const int pieces = k / 8;
  auto load = [&](uint4 (&buf)[ROWS][CH], int g) {
    const uint4* rows = reinterpret_cast<const uint4*>(w + (int64_t(g) * BLOCK_ROWS + warp * ROWS) * k);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int c = 0; c < CH; ++c) buf[r][c] = __ldg(rows + int64_t(r) * pieces + c * 32 + lane);
  };
  auto multiply = [&](const uint4 (&buf)[ROWS][CH], const float (&xs)[CH][8], int g) {
    float acc[ROWS] = {};
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = dot8(buf[r][c], xs[c], acc[r]);
    store_rows(acc, y, int64_t(g) * BLOCK_ROWS + warp * ROWS, lane);
  };
  uint4 a[ROWS][CH], b[ROWS][CH];
  int g = blockIdx.x;
  load(a, g);
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  float xs[CH][8];
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int kk = (c * 32 + lane) * 8 + j;
      xs[c][j] = kk < xk ? x[kk] : 0.0f;
    }
  for (; g < groups; g += 2 * gridDim.x) {
    const int g2 = g + gridDim.x;
    if (g2 < groups) load(b, g2);
    multiply(a, xs, g);
    if (g2 < groups) {
      if (g2 + gridDim.x < groups) load(a, g2 + gridDim.x);
      multiply(b, xs, g2);
    }
  }
}

int stream_blocks() {
  static int blocks = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, matvec_stream<8>, WARPS * 32, 0);
    return sms * std::max(per_sm, 1);
  }();
  return blocks;
}

cudaError_t launch(cudaStream_t stream, const float* x, int xk, const __nv_bfloat16* w, float* y, int n, int k,
                   int pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(n / BLOCK_ROWS);
  config.blockDim = dim3(WARPS * 32);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  const int groups = n / BLOCK_ROWS;
  if (k == 2048 && groups > 2 * stream_blocks()) {
    config.gridDim = dim3(stream_blocks());
    return cudaLaunchKernelEx(&config, matvec_stream<8>, x, xk, w, y, k, n, pdl);
  }
  switch (k) {
    case 512: return cudaLaunchKernelEx(&config, matvec<2, true>, x, xk, w, y, k, pdl);
    case 1024: return cudaLaunchKernelEx(&config, matvec<4, true>, x, xk, w, y, k, pdl);
    case 1536: return cudaLaunchKernelEx(&config, matvec<6, true>, x, xk, w, y, k, pdl);
    case 2048: return cudaLaunchKernelEx(&config, matvec<8, true>, x, xk, w, y, k, pdl);
    default:
      config.dynamicSmemBytes = size_t(k) * sizeof(float);
      if (config.dynamicSmemBytes > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(matvec<8, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     int(config.dynamicSmemBytes));
        if (err != cudaSuccess) return err;
      }
      return cudaLaunchKernelEx(&config, matvec<8, false>, x, xk, w, y, k, pdl);
  }
}

// Products l = 0..L-1 of shapes [ns[l], ks[l]], packed one after another in w; product l
// reads product l-1's output (x for l = 0) as its input, cut or zero-padded to ks[l].
// scratch holds two outputs of the largest n; y is the last product's output.
ffi::Error Chain(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> scratch, ffi::Span<const int64_t> ns,
                 ffi::Span<const int64_t> ks, int32_t pdl) {
  const int64_t layers = int64_t(ns.size());
  if (layers == 0 || int64_t(ks.size()) != layers) return ffi::Error::InvalidArgument("ns and ks: one per product");
  int64_t total = 0, widest = 0;
  for (int64_t l = 0; l < layers; ++l) {
    if (ns[l] % BLOCK_ROWS || ks[l] % 8) return ffi::Error::InvalidArgument("n % 16 and k % 8 must be 0");
    total += ns[l] * ks[l];
    widest = std::max(widest, ns[l]);
  }
  if (total != int64_t(w.element_count()) || y->element_count() != ns[layers - 1] ||
      scratch->element_count() < 2 * widest)
    return ffi::Error::InvalidArgument("w, y or scratch does not match ns and ks");
  const auto* wl = reinterpret_cast<const __nv_bfloat16*>(w.typed_data());
  const float* in = x.typed_data();
  int64_t in_n = x.element_count();
  for (int64_t l = 0; l < layers; ++l) {
    float* out = l == layers - 1 ? y->typed_data() : scratch->typed_data() + (l % 2) * widest;
    const cudaError_t err = launch(stream, in, int(std::min(in_n, ks[l])), wl, out, int(ns[l]), int(ks[l]), pdl);
    if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
    wl += ns[l] * ks[l];
    in = out;
    in_n = ns[l];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPdlChain, Chain,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Attr<ffi::Span<const int64_t>>("ks")
                                  .Attr<int32_t>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
