// A chain of L dependent one-row products in hand-written CUDA, called as one XLA FFI
// custom call: y = W[L-1] (... (W[1] (W[0] x))), x and y float32 [K], W bf16 [L, K, K]
// (each W[l] stored [out, in], so a row of it is contiguous).
//
// One kernel a product. A warp owns ROWS output rows: it loads their bf16 weights into
// registers first, then (with `pdl`) lets the next kernel launch
// (`griddepcontrol.launch_dependents`) and waits for the previous one
// (`griddepcontrol.wait`), and only then reads the previous kernel's output, so a kernel's
// weight reads can overlap its predecessor. Without `pdl` the kernels run one after the
// other as usual. The kernels are launched with programmatic stream serialization when
// `pdl` is set.
//
// Benchmark code (benchmarks/cuda_pdl_chain.py builds it with nvcc); not part of jspec.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int WARPS = 8;
constexpr int ROWS = 2;                     // output rows a warp computes
constexpr int BLOCK_ROWS = WARPS * ROWS;  // output rows a block computes

template <int CHUNKS>  // K / 256: 16-byte weight pieces a lane holds a row
__global__ void __launch_bounds__(WARPS * 32) matvec(const float* x, const __nv_bfloat16* __restrict__ w,
                                                     float* y, int k, int pdl) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.x) * BLOCK_ROWS + warp * ROWS;
  uint4 wv[ROWS][CHUNKS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      wv[r][c] = __ldg(reinterpret_cast<const uint4*>(w + (row0 + r) * k + (c * 32 + lane) * 8));
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  float acc[ROWS] = {};
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int kk = (c * 32 + lane) * 8;
    const float4 xa = *reinterpret_cast<const float4*>(x + kk);
    const float4 xb = *reinterpret_cast<const float4*>(x + kk + 4);
    const float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&wv[r][c]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(p[j]);
        acc[r] = fmaf(f.x, xs[2 * j], acc[r]);
        acc[r] = fmaf(f.y, xs[2 * j + 1], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    if (lane == 0) y[row0 + r] = acc[r];
  }
}

template <int CHUNKS>
cudaError_t launch(cudaStream_t stream, const float* x, const __nv_bfloat16* w, float* y, int k, int pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(k / BLOCK_ROWS);
  config.blockDim = dim3(WARPS * 32);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, matvec<CHUNKS>, x, w, y, k, pdl);
}

ffi::Error Chain(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> scratch, int32_t pdl) {
  const auto dims = w.dimensions();
  if (dims.size() != 3 || dims[1] != dims[2] || x.element_count() != dims[2] || dims[2] % 256 != 0)
    return ffi::Error::InvalidArgument("want x [K] and w [L, K, K] with K a multiple of 256");
  const int layers = int(dims[0]), k = int(dims[2]);
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.typed_data());
  const float* in = x.typed_data();
  for (int l = 0; l < layers; ++l) {
    float* out = l == layers - 1 ? y->typed_data() : scratch->typed_data() + (l % 2) * k;
    const __nv_bfloat16* wl = wp + int64_t(l) * k * k;
    cudaError_t err;
    switch (k / 256) {
      case 4: err = launch<4>(stream, in, wl, out, k, pdl); break;
      case 6: err = launch<6>(stream, in, wl, out, k, pdl); break;
      case 8: err = launch<8>(stream, in, wl, out, k, pdl); break;
      default: return ffi::Error::InvalidArgument("K must be 1024, 1536 or 2048");
    }
    if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
    in = out;
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
                                  .Attr<int32_t>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
