// The CUDA backend's runtime plumbing: device detection, memory-space checks, and calls captured
// into a CUDA graph.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

TEST_CASE("device pointers are told apart from host pointers", "[cuda]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  float* device = nullptr;
  attnmix::detail::cuda::check(cudaMalloc(&device, 64 * sizeof(float)), "cudaMalloc");
  float host[64] = {};
  CHECK(attnmix::detail::cuda::is_device_pointer(device));
  CHECK_FALSE(attnmix::detail::cuda::is_device_pointer(host));

  attnmix::view1<float> good(device, {64}, attnmix::memory_space::device);
  attnmix::view1<float> lying(host, {64}, attnmix::memory_space::device);
  CHECK_NOTHROW(attnmix::detail::cuda::check_device_pointer("f", "x", good));
  try {
    attnmix::detail::cuda::check_device_pointer("f", "x", lying);
    FAIL("a host pointer passed as device memory was accepted");
  } catch (const attnmix::error& e) {
    CHECK(std::string(e.what()).find("argument 'x' is marked as device memory") !=
          std::string::npos);
  }
  attnmix::detail::cuda::check(cudaFree(device), "cudaFree");
}

TEST_CASE("runtime failures become attnmix::cuda_error", "[cuda]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  CHECK_THROWS_AS(attnmix::detail::cuda::check(cudaErrorInvalidValue, "probe"),
                  attnmix::cuda_error);
}

// A call captured into a graph reads its host arrays (the caller's cu_seqlens, the launcher's own
// temporaries such as the causal backward's state slots) when it is captured, as an eager call
// reads them when it is made: the graph must not read them again at replay, when the caller has
// changed them and the temporaries are gone. A packed causal linear-attention forward and backward
// (bfloat16, D = 64: the tensor-core backward) are captured, the host offsets are then overwritten,
// and two replays must give the eager call's bits.
TEST_CASE("a captured call keeps the host arrays it was given", "[cuda][graph]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using attnmix::bfloat16;
  using attnmix::view4;
  using attnmix_test::device_buffer;
  namespace k = attnmix::detail::cuda;
  const attnmix::index_t T = 300, HQ = 4, H = 2, D = 64;
  attnmix_test::rng r(77);
  auto random = [&](std::size_t n) {
    std::vector<bfloat16> x(n);
    for (auto& e : x) e = bfloat16(float(r.uniform(-1, 1)));
    return x;
  };
  const std::size_t nq = std::size_t(T * HQ * D), nk = std::size_t(T * H * D);
  const device_buffer<bfloat16> q(random(nq)), kk(random(nk)), v(random(nk)), dout(random(nq));
  struct outputs {
    device_buffer<bfloat16> out, dq, dk, dv;
    explicit outputs(std::size_t nq, std::size_t nk) : out(nq), dq(nq), dk(nk), dv(nk) {}
    std::vector<std::vector<bfloat16>> bits() const {
      return {out.to_host(), dq.to_host(), dk.to_host(), dv.to_host()};
    }
  };
  const std::vector<std::int32_t> offsets = {0, 5, 5, 6, 70, 200, 300};
  auto run = [&](const outputs& o, const std::vector<std::int32_t>& cu, cudaStream_t stream) {
    const auto dev = attnmix::memory_space::device;
    attnmix::linear_attention_params p;
    p.cu_seqlens = attnmix::view1<const std::int32_t>(cu.data(), {attnmix::index_t(cu.size())});
    attnmix::linear_attention_args<bfloat16> f;
    f.q = view4<const bfloat16>(q.get(), {1, T, HQ, D}, dev);
    f.k = view4<const bfloat16>(kk.get(), {1, T, H, D}, dev);
    f.v = view4<const bfloat16>(v.get(), {1, T, H, D}, dev);
    f.out = view4<bfloat16>(o.out.get(), {1, T, HQ, D}, dev);
    attnmix::linear_attention<attnmix::kind::linear_causal>(f, p, attnmix::backend::cuda{stream});
    attnmix::linear_attention_grad_args<bfloat16> g;
    g.q = f.q, g.k = f.k, g.v = f.v;
    g.dout = view4<const bfloat16>(dout.get(), {1, T, HQ, D}, dev);
    g.dq = view4<bfloat16>(o.dq.get(), {1, T, HQ, D}, dev);
    g.dk = view4<bfloat16>(o.dk.get(), {1, T, H, D}, dev);
    g.dv = view4<bfloat16>(o.dv.get(), {1, T, H, D}, dev);
    attnmix::linear_attention_backward<attnmix::kind::linear_causal>(
        g, p, attnmix::backend::cuda{stream});
  };
  cudaStream_t stream = nullptr;
  k::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const outputs eager(nq, nk), captured(nq, nk);
  run(eager, offsets, stream);
  k::check(cudaStreamSynchronize(stream), "eager call");

  std::vector<std::int32_t> held = offsets;
  cudaGraph_t graph = nullptr;
  k::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  run(captured, held, stream);
  k::check(cudaStreamEndCapture(stream, &graph), "end capture");
  std::fill(held.begin(), held.end(), std::int32_t(1) << 30);  // what a replay must not read
  cudaGraphExec_t exec = nullptr;
  k::check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  k::check(cudaGraphDestroy(graph), "cudaGraphDestroy");  // the executable keeps what it needs
  for (int replay = 0; replay < 2; ++replay) {
    k::check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    k::check(cudaStreamSynchronize(stream), "replay");
    const auto want = eager.bits(), got = captured.bits();
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("replay " << replay << ", output " << i << " (out, dq, dk, dv)");
      REQUIRE(got[i].size() == want[i].size());
      CHECK(std::memcmp(got[i].data(), want[i].data(), want[i].size() * sizeof(bfloat16)) == 0);
    }
  }
  k::check(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  k::check(cudaStreamDestroy(stream), "cudaStreamDestroy");
}
