// pybind11 bindings of the residual-norm kernels (module _opfuse_residual_norm). Tensors cross as
// raw device addresses (Python ints, 0 = absent) and streams as cudaStream_t handles; the Python
// side (residual_norm/cuda.py) checks shapes, dtypes, devices and contiguity before calling. A
// kernel error raises RuntimeError.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "pybind_codes.h"
#include "residual_norm.h"

namespace py = pybind11;

namespace {

template <typename T = void>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void check(const char* error, const char* what) {
  if (error) throw std::runtime_error(std::string(what) + ": " + error);
}

opfuse::ResidualNormArgs make_args(uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t weight,
                                   uintptr_t norm_bias, uintptr_t y, uintptr_t h, int64_t tokens, int64_t hidden,
                                   float eps, int norm, int dtype) {
  opfuse::ResidualNormArgs args;
  args.x = ptr(x);
  args.bias = ptr(bias);
  args.residual = ptr(residual);
  args.weight = ptr(weight);
  args.norm_bias = ptr(norm_bias);
  args.y = ptr(y);
  args.h = ptr(h);
  args.tokens = tokens;
  args.hidden = hidden;
  args.eps = eps;
  args.norm = norm;
  args.dtype = dtype;
  return args;
}

// The FP8 epilogue of a launch (QuantMode, residual_norm.h); addresses are Python ints, 0 = absent.
struct Fp8Epilogue {
  int quant = 0;
  int fp8 = 0;
  uintptr_t q = 0;
  uintptr_t scales = 0;
  uintptr_t amax = 0;

  void apply(opfuse::ResidualNormArgs& args) const {
    args.quant = quant;
    args.fp8 = fp8;
    args.q = ptr(q);
    args.scales = ptr<float>(scales);
    args.amax = ptr<const float>(amax);
  }
};

// A launcher taking an epilogue first, as the plain launcher (no epilogue: y in the activation dtype).
template <typename... A>
auto without_epilogue(void (*launch)(const Fp8Epilogue&, A...)) {
  return [launch](A... a) { launch(Fp8Epilogue{}, a...); };
}

cudaStream_t stream_of(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

opfuse::PeerWait make_wait(uintptr_t flag, uintptr_t record, uint64_t timeout_ns, int op) {
  opfuse::PeerWait wait;
  wait.flag = ptr<uint32_t>(flag);
  wait.record = ptr<opfuse::PeerWaitRecord>(record);
  wait.timeout_ns = timeout_ns;
  wait.op = op;
  return wait;
}

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// The flag (device memory) and the record (host-mapped pinned memory) of one region's bounded
// waits (peer_wait.h), on the current device. Read without a stream sync.
class PeerWatch {
 public:
  PeerWatch() {
    void* host = nullptr;
    cuda_check(cudaHostAlloc(&host, sizeof(opfuse::PeerWaitRecord), cudaHostAllocMapped | cudaHostAllocPortable),
               "PeerWatch: cudaHostAlloc");
    host_ = static_cast<opfuse::PeerWaitRecord*>(host);
    *host_ = opfuse::PeerWaitRecord{};
    void* device_record = nullptr;
    cuda_check(cudaHostGetDevicePointer(&device_record, host, 0), "PeerWatch: cudaHostGetDevicePointer");
    record_ = reinterpret_cast<uintptr_t>(device_record);
    void* flag = nullptr;
    cuda_check(cudaMalloc(&flag, sizeof(uint32_t)), "PeerWatch: cudaMalloc");
    cuda_check(cudaMemset(flag, 0, sizeof(uint32_t)), "PeerWatch: cudaMemset");
    flag_ = reinterpret_cast<uintptr_t>(flag);
  }
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;
  ~PeerWatch() {
    // Errors are ignored: at interpreter exit the CUDA context may be gone already.
    cudaFree(reinterpret_cast<void*>(flag_));
    cudaFreeHost(host_);
  }

  bool failed() const { return reinterpret_cast<volatile const opfuse::PeerWaitRecord*>(host_)->failed != 0; }

  py::tuple read() const {
    volatile const opfuse::PeerWaitRecord* r = host_;
    return py::make_tuple(r->failed != 0, static_cast<int>(r->site), static_cast<int>(r->rank),
                          static_cast<int>(r->peer), static_cast<int>(r->op), static_cast<int>(r->block),
                          static_cast<uint64_t>(r->waited_ns));
  }

  uintptr_t flag() const { return flag_; }
  uintptr_t record() const { return record_; }

 private:
  opfuse::PeerWaitRecord* host_ = nullptr;
  uintptr_t record_ = 0;
  uintptr_t flag_ = 0;
};

// A peer kernel's launch (allreduce_oneshot / allreduce_twoshot / allreduce_lamport, whose int is
// the grid argument: max_blocks / blocks; then pdl).
using PeerKernel = const char* (*)(const opfuse::ResidualNormArgs&, const opfuse::PeerRegion&, const opfuse::PeerWait&,
                                   int, bool, cudaStream_t);

template <PeerKernel kernel>
const char* peer_kernel_name() {
  if (kernel == &opfuse::allreduce_oneshot) return "allreduce_oneshot";
  if (kernel == &opfuse::allreduce_twoshot) return "allreduce_twoshot";
  return "allreduce_lamport";
}

template <PeerKernel kernel>
void launch_peer(const Fp8Epilogue& epilogue, uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t weight,
                 uintptr_t norm_bias, uintptr_t y, uintptr_t h, int64_t tokens, int64_t hidden, float eps, int norm,
                 int dtype, const opfuse::PeerRegion& region, uintptr_t flag, uintptr_t record, uint64_t timeout_ns,
                 int op, int grid, uintptr_t stream, bool pdl) {
  auto args = make_args(x, bias, residual, weight, norm_bias, y, h, tokens, hidden, eps, norm, dtype);
  epilogue.apply(args);
  check(kernel(args, region, make_wait(flag, record, timeout_ns, op), grid, pdl, stream_of(stream)),
        peer_kernel_name<kernel>());
}

// The launchers' Python arguments (the *_fp8 variants take ``epilogue`` first); ``pdl`` defaults
// to off, so positional callers of the earlier signature keep the plain launch.
#define OPFUSE_PEER_ARGS                                                                                        \
  py::arg("x"), py::arg("bias"), py::arg("residual"), py::arg("weight"), py::arg("norm_bias"), py::arg("y"),   \
      py::arg("h"), py::arg("tokens"), py::arg("hidden"), py::arg("eps"), py::arg("norm"), py::arg("dtype"),     \
      py::arg("region"), py::arg("flag"), py::arg("record"), py::arg("timeout_ns"), py::arg("op"), py::arg("grid"), \
      py::arg("stream"), py::arg("pdl") = false

void launch_add_norm(const Fp8Epilogue& epilogue, uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t weight,
                     uintptr_t norm_bias, uintptr_t y, uintptr_t h, int64_t tokens, int64_t hidden, float eps, int norm,
                     int dtype, int max_blocks, uintptr_t stream) {
  auto args = make_args(x, bias, residual, weight, norm_bias, y, h, tokens, hidden, eps, norm, dtype);
  epilogue.apply(args);
  check(opfuse::add_norm(args, max_blocks, stream_of(stream)), "add_norm");
}

}  // namespace

PYBIND11_MODULE(_opfuse_residual_norm, m) {
  m.doc() = "opfuse residual-norm kernels (all-reduce + residual + norm over peer memory, fused norms)";
  opfuse::export_dtype_codes(m);
  pybind11::dict norms;
  norms["none"] = static_cast<int>(opfuse::NormKind::kNone);
  norms["rms"] = static_cast<int>(opfuse::NormKind::kRMS);
  norms["layer"] = static_cast<int>(opfuse::NormKind::kLayer);
  m.attr("NORMS") = norms;

  py::class_<opfuse::PeerRegion>(m, "PeerRegion")
      .def(py::init([](uintptr_t peers, uintptr_t local, int rank, int world, int64_t bytes, int64_t capacity) {
             opfuse::PeerRegion region;
             region.peers = ptr<const uint64_t>(peers);
             if (world < 1 || world > opfuse::kMaxWorld)
               throw std::invalid_argument("PeerRegion: world " + std::to_string(world) + " is outside 1.." +
                                           std::to_string(opfuse::kMaxWorld));
             // The kernels take the addresses by value (PeerAddresses): read them once, here.
             const cudaError_t copied =
                 cudaMemcpy(region.addresses.at, region.peers, world * sizeof(uint64_t), cudaMemcpyDeviceToHost);
             if (copied != cudaSuccess)
               throw std::runtime_error(std::string("PeerRegion: reading the peer addresses: ") +
                                        cudaGetErrorString(copied));
             region.local = ptr(local);
             region.rank = rank;
             region.world = world;
             region.bytes = bytes;
             region.capacity = capacity;
             return region;
           }),
           py::arg("peers"), py::arg("local"), py::arg("rank"), py::arg("world"), py::arg("bytes"),
           py::arg("capacity"))
      .def_readonly("rank", &opfuse::PeerRegion::rank)
      .def_readonly("world", &opfuse::PeerRegion::world)
      .def_readonly("bytes", &opfuse::PeerRegion::bytes)
      .def_readonly("capacity", &opfuse::PeerRegion::capacity)
      .def(
          "set_timeline", [](opfuse::PeerRegion& region, uintptr_t stamps) { region.timeline = ptr<uint64_t>(stamps); },
          "Record the one-shot's phase times into ``stamps`` (a device uint64 array of TIMELINE_CALLS x "
          "CALL_SLOTS x TIMELINE_PHASES, indexed [calls % TIMELINE_CALLS, block, phase]); 0 stops recording.",
          py::arg("stamps"));

  py::class_<PeerWatch>(m, "PeerWatch")
      .def(py::init<>())
      .def("failed", &PeerWatch::failed)
      .def("read", &PeerWatch::read, "(failed, site, rank, peer, op, block, waited_ns)")
      .def_property_readonly("flag", &PeerWatch::flag)
      .def_property_readonly("record", &PeerWatch::record);
  pybind11::dict sites;
  sites["one-shot"] = static_cast<int>(opfuse::PeerWaitSite::kOneShot);
  sites["two-shot reduce-scatter"] = static_cast<int>(opfuse::PeerWaitSite::kTwoShotReduceScatter);
  sites["two-shot all-gather"] = static_cast<int>(opfuse::PeerWaitSite::kTwoShotAllGather);
  sites["Lamport two-shot reduce-scatter"] = static_cast<int>(opfuse::PeerWaitSite::kLamportReduceScatter);
  sites["Lamport two-shot all-gather"] = static_cast<int>(opfuse::PeerWaitSite::kLamportAllGather);
  m.attr("PEER_WAIT_SITES") = sites;

  m.attr("MAX_WORLD") = opfuse::kMaxWorld;
  m.attr("MAX_BLOCKS") = opfuse::kMaxBlocks;
  m.attr("CALL_SLOTS") = opfuse::kCallSlots;
  m.attr("TIMELINE_CALLS") = opfuse::kTimelineCalls;
  m.attr("TIMELINE_PHASES") = opfuse::kTimelinePhases;
  m.def("oneshot_region_bytes", &opfuse::oneshot_region_bytes, py::arg("world"), py::arg("capacity"));
  m.def("twoshot_region_bytes", &opfuse::twoshot_region_bytes, py::arg("world"), py::arg("capacity"));
  m.def("lamport_region_bytes", &opfuse::lamport_region_bytes, py::arg("world"), py::arg("capacity"));

  m.def("oneshot_init", [](const opfuse::PeerRegion& region, int dtype, uintptr_t stream) {
    check(opfuse::oneshot_init(region, dtype, stream_of(stream)), "oneshot_init");
  });
  m.def("twoshot_init", [](const opfuse::PeerRegion& region, uintptr_t stream) {
    check(opfuse::twoshot_init(region, stream_of(stream)), "twoshot_init");
  });
  m.def("lamport_init", [](const opfuse::PeerRegion& region, int dtype, uintptr_t stream) {
    check(opfuse::lamport_init(region, dtype, stream_of(stream)), "lamport_init");
  });

  // The launches take the region's PeerWatch as (flag, record) addresses, the timeout in ns and
  // the caller's op code (peer_wait.h). The *_fp8 variants take an Fp8Epilogue first.
  py::class_<Fp8Epilogue>(m, "Fp8Epilogue")
      .def(py::init([](int quant, int fp8, uintptr_t q, uintptr_t scales, uintptr_t amax) {
             return Fp8Epilogue{quant, fp8, q, scales, amax};
           }),
           py::arg("quant"), py::arg("fp8"), py::arg("q"), py::arg("scales"), py::arg("amax") = 0)
      .def_readonly("quant", &Fp8Epilogue::quant);
  pybind11::dict quant;
  quant["none"] = static_cast<int>(opfuse::QuantMode::kNone);
  quant["rowwise"] = static_cast<int>(opfuse::QuantMode::kRowwise);
  quant["row_amax"] = static_cast<int>(opfuse::QuantMode::kRowAmax);
  quant["tensor"] = static_cast<int>(opfuse::QuantMode::kTensor);
  m.attr("QUANT") = quant;
  pybind11::dict fp8_formats;
  fp8_formats["e4m3"] = static_cast<int>(opfuse::Fp8Format::kE4M3);
  fp8_formats["e5m2"] = static_cast<int>(opfuse::Fp8Format::kE5M2);
  m.attr("FP8_FORMATS") = fp8_formats;
  m.def("allreduce_oneshot", without_epilogue(&launch_peer<&opfuse::allreduce_oneshot>), OPFUSE_PEER_ARGS);
  m.def("allreduce_oneshot_fp8", &launch_peer<&opfuse::allreduce_oneshot>, py::arg("epilogue"), OPFUSE_PEER_ARGS);
  m.def("allreduce_twoshot", without_epilogue(&launch_peer<&opfuse::allreduce_twoshot>), OPFUSE_PEER_ARGS);
  m.def("allreduce_twoshot_fp8", &launch_peer<&opfuse::allreduce_twoshot>, py::arg("epilogue"), OPFUSE_PEER_ARGS);
  m.def("allreduce_lamport", without_epilogue(&launch_peer<&opfuse::allreduce_lamport>), OPFUSE_PEER_ARGS);
  m.def("allreduce_lamport_fp8", &launch_peer<&opfuse::allreduce_lamport>, py::arg("epilogue"), OPFUSE_PEER_ARGS);
  m.def("add_norm", without_epilogue(&launch_add_norm));
  m.def("add_norm_fp8", &launch_add_norm);
  m.def("rms_norm_backward",
        [](uintptr_t dy, uintptr_t h, uintptr_t weight, uintptr_t dh_out, uintptr_t dh, uintptr_t dw_partial,
           uintptr_t dw, int64_t tokens, int64_t hidden, float eps, int dtype, int blocks, uintptr_t stream) {
          opfuse::RMSNormBackwardArgs args;
          args.dy = ptr(dy);
          args.h = ptr(h);
          args.weight = ptr(weight);
          args.dh_out = ptr(dh_out);
          args.dh = ptr(dh);
          args.dw_partial = ptr<float>(dw_partial);
          args.dw = ptr(dw);
          args.tokens = tokens;
          args.hidden = hidden;
          args.eps = eps;
          args.dtype = dtype;
          check(opfuse::rms_norm_backward(args, blocks, stream_of(stream)), "rms_norm_backward");
        });
  m.def("layer_norm_backward",
        [](uintptr_t dy, uintptr_t h, uintptr_t weight, uintptr_t dh_out, uintptr_t dh, uintptr_t partial,
           uintptr_t dw, uintptr_t db, int64_t tokens, int64_t hidden, float eps, int dtype, int blocks,
           uintptr_t stream) {
          opfuse::LayerNormBackwardArgs args;
          args.dy = ptr(dy);
          args.h = ptr(h);
          args.weight = ptr(weight);
          args.dh_out = ptr(dh_out);
          args.dh = ptr(dh);
          args.partial = ptr<float>(partial);
          args.dw = ptr(dw);
          args.db = ptr(db);
          args.tokens = tokens;
          args.hidden = hidden;
          args.eps = eps;
          args.dtype = dtype;
          check(opfuse::layer_norm_backward(args, blocks, stream_of(stream)), "layer_norm_backward");
        },
        "dh = LayerNorm's input gradient (+ dh_out); dw, db = the weight and bias gradients (0 = not asked). "
        "partial: [2, blocks, hidden] float32 scratch when dw or db is asked.",
        py::arg("dy"), py::arg("h"), py::arg("weight"), py::arg("dh_out"), py::arg("dh"), py::arg("partial"),
        py::arg("dw"), py::arg("db"), py::arg("tokens"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"),
        py::arg("blocks"), py::arg("stream"));
}
