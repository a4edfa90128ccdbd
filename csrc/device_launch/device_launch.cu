// Device-side launch of a captured CUDA graph behind a staging copy (engine/device_launch.py).
//
// Why: cudaGraphLaunch of the whole cached forward (~150 kernel nodes) costs the model thread
// 0.13 ms (batch 1) to 0.33 ms (batch 8) before the GPU starts it. Here the host launches a graph of
// one kernel instead. That kernel copies the batch's staging slot (pinned host memory, read through
// its mapped address: packed metadata and inputs) into the bucket's device buffer, then tail-launches
// the forward graph from the device. The host's cost is one small graph launch.
//
// Layout: `src` is a pinned host block mapped into the device's address space, `dst` a device block
// of the same `bytes`; both 16-byte aligned (checked at build time of the launcher, on the host).
//
// Contracts (CUDA programming guide, "Device Graph Launch"):
//   - the forward graph is instantiated with cudaGraphInstantiateFlagDeviceLaunch and uploaded
//     (hstu_dl_instantiate) before a launcher may launch it;
//   - a kernel may launch a graph only while it runs inside a graph: the launcher is a graph of one
//     kernel node (hstu_dl_launcher), launched on the caller's stream (hstu_dl_launch);
//   - a tail launch starts after the launching graph's work completed (the whole copy), and the
//     launching graph counts as complete on its stream only once its tail launches completed, so
//     work enqueued after hstu_dl_launch (the logits copy, events) runs after the forward;
//   - a graph runs one instance at a time: the stream order above keeps a bucket's forward from
//     being launched again before its last launch completed.
// A device-side launch error cannot be returned to the host: a serving launcher's kernel traps
// instead, which fails the stream's next synchronisation loudly (a sticky launch failure) rather
// than serving logits the forward never computed. So each forward is probed once first
// (hstu_dl_probe: the same kernel reporting the error in a mapped word) and kept on the host launch
// where the probe fails.
//
// Built by nvcc alone (relocatable device code and libcudadevrt, which torch's JIT build cannot
// device-link) into a small shared library that engine/device_launch.py loads with ctypes. Every
// entry point returns a cudaError_t (0 on success); hstu_dl_error_string names it.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

__global__ void stage_then_launch(const uint4* __restrict__ src, uint4* __restrict__ dst, long long words,
                                  cudaGraphExec_t forward, int* status) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    dst[i] = src[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const cudaError_t err = cudaGraphLaunch(forward, cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) {
      if (status == nullptr) __trap();  // a serving launch: fail the stream, never skip the forward
      *status = static_cast<int>(err);  // a probe: the host reads why
      __threadfence_system();
    }
  }
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 64;  // enough loads in flight over PCIe for the largest slot (~0.4 MB)

// An exec of a graph of one stage_then_launch node copying `words` 16-byte words (none: a probe).
cudaError_t one_node_graph(const uint4* src, uint4* dst, long long words, cudaGraphExec_t forward, int* status,
                           void** exec_out) {
  const long long wanted = (words + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 1 ? 1 : wanted < kMaxBlocks ? wanted : kMaxBlocks);
  void* args[] = {&src, &dst, &words, &forward, &status};
  cudaKernelNodeParams params{};
  params.func = reinterpret_cast<void*>(stage_then_launch);
  params.gridDim = dim3(blocks);
  params.blockDim = dim3(kThreads);
  params.sharedMemBytes = 0;
  params.kernelParams = args;
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaGraphCreate(&graph, 0);
  if (err != cudaSuccess) return err;
  cudaGraphNode_t node = nullptr;
  err = cudaGraphAddKernelNode(&node, graph, nullptr, 0, &params);
  cudaGraphExec_t exec = nullptr;
  if (err == cudaSuccess) err = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) return err;
  *exec_out = exec;
  return cudaSuccess;
}

}  // namespace

extern "C" {

const char* hstu_dl_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// Instantiate `graph` (a cudaGraph_t) for launch from the device and upload it on `stream`.
// `device` is made current first: this library has its own runtime instance, which a thread's first
// call would otherwise leave without the primary context torch uses.
int hstu_dl_instantiate(int device, void* graph, void* stream, void** exec_out) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiateWithFlags(&exec, static_cast<cudaGraph_t>(graph),
                                                  cudaGraphInstantiateFlagDeviceLaunch);
  if (err != cudaSuccess) return err;
  err = cudaGraphUpload(exec, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    cudaGraphExecDestroy(exec);
    return err;
  }
  *exec_out = exec;
  return cudaSuccess;
}

// A graph of one stage_then_launch node: copy `bytes` from the pinned block `host_src` (a host
// pointer, mapped here) to the device block `dst`, then tail-launch `forward`.
int hstu_dl_launcher(int device, void* host_src, void* dst, long long bytes, void* forward, void** exec_out) {
  if (bytes <= 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) return cudaErrorInvalidValue;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  void* mapped = nullptr;
  err = cudaHostGetDevicePointer(&mapped, host_src, 0);
  if (err != cudaSuccess) return err;
  if (reinterpret_cast<uintptr_t>(mapped) % 16 != 0) return cudaErrorInvalidValue;
  return one_node_graph(static_cast<const uint4*>(mapped), static_cast<uint4*>(dst), bytes / 16,
                        static_cast<cudaGraphExec_t>(forward), nullptr, exec_out);
}

// Whether `forward` launches from the device here and now: a launcher that copies nothing and
// reports a failed launch in a mapped word instead of trapping, run once on `stream` and waited
// for. *launch_error: 0, or the device-side cudaGraphLaunch's error. Run where replaying `forward`
// is harmless (right after its capture, its inputs the capture's own). Why: a device launch that
// fails in service traps and takes the context with it, so a process where it cannot work (a tool
// attached through CUPTI, for instance) must find out before serving.
int hstu_dl_probe(int device, void* forward, void* stream, int* launch_error) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  int* status = nullptr;
  err = cudaHostAlloc(&status, sizeof(int), cudaHostAllocMapped);
  if (err != cudaSuccess) return err;
  *status = 0;
  int* mapped = nullptr;
  cudaGraphExec_t exec = nullptr;
  err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), status, 0);
  if (err == cudaSuccess) {
    err = one_node_graph(nullptr, nullptr, 0, static_cast<cudaGraphExec_t>(forward), mapped, reinterpret_cast<void**>(&exec));
  }
  if (err == cudaSuccess) err = cudaGraphLaunch(exec, static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) *launch_error = *status;
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  cudaFreeHost(status);
  return err;
}

// The model thread's launch; torch made the device current on it.
int hstu_dl_launch(void* exec, void* stream) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(stream));
}

int hstu_dl_destroy(void* exec) { return cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)); }

}  // extern "C"
