// Host emulation of the CUDA PaTH backward kernels (one thread per CTA, passes in order) against
// the CPU backward: checks the algebra and the indexing, not races.
#include <cstdio>
#include <cstring>
#include <limits>

#include "attnmix/attnmix.hpp"
#include "attnmix/cuda/plan/path_backward.hpp"
#include "cpu/test_path_harness.hpp"
#include "kernels.hpp"

using namespace attnmix_test;
using attnmix::index_t;
namespace cu = attnmix::detail::cuda;

struct grads {
  std::vector<double> dq, dk, dv, dw, dbeta, dg;
};

double max_rel(const std::vector<double>& got, const std::vector<double>& ref) {
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::abs(got[i] - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  return mag > 0 ? diff / mag : diff;
}

template <class Kind, class Policy>
bool run_case(const path_case& c, std::uint64_t salt, std::vector<index_t> g_inf, int sms) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  path_inputs in = make_path_inputs(c, salt);
  for (index_t t : g_inf)
    for (index_t hq = 0; hq < c.HQ; ++hq)
      in.g[t * c.HQ + hq] = -std::numeric_limits<double>::infinity();
  path_tensors<float> t(c, in);
  attnmix::attention<Kind, Policy>(t.template args<Kind>(), path_params(c),
                                   attnmix::backend::cpu{0});
  rng r(salt + 9);
  attnmix::host_tensor<float, 4> dO({c.B, c.T, c.HQ, c.Dv}), dq({c.B, c.T, c.HQ, c.D}),
      dk({c.B, c.T, c.H, c.D}), dv({c.B, c.T, c.H, c.Dv}), dw({c.B, c.T, c.H, c.D});
  attnmix::host_tensor<float, 3> dbeta({c.B, c.T, c.H}), dg({c.B, c.T, c.HQ});
  for (auto& x : dO.storage()) x = float(r.normal());
  attnmix::attention_grad_args<float> a;
  a.q = t.q.view(), a.k = t.k.view(), a.v = t.v.view();
  a.w = t.w.view(), a.beta = t.beta.view();
  a.out = t.out.view(), a.lse = t.lse.view(), a.dout = dO.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view(), a.dw = dw.view(), a.dbeta = dbeta.view();
  if constexpr (gated) a.g = t.g.view(), a.dg = dg.view();
  attnmix::attention_backward<Kind, Policy>(a, path_params(c), attnmix::backend::cpu{0});
  grads ref{to_double(dq.storage()), to_double(dk.storage()),    to_double(dv.storage()),
            to_double(dw.storage()), to_double(dbeta.storage()), to_double(dg.storage())};

  // The emulated GPU path, into NaN-filled outputs.
  poison(dq), poison(dk), poison(dv), poison(dw), poison(dbeta), poison(dg);
  attnmix::attention_problem p{c.B,
                               c.T,
                               c.HQ,
                               c.H,
                               c.D,
                               c.Dv,
                               1.0 / std::sqrt(double(c.D)),
                               0,
                               c.cu_seqlens.empty() ? nullptr : c.cu_seqlens.data(),
                               c.sequences()};
  index_t max_len = 0;
  for (index_t n = 0; n < p.num_sequences; ++n) max_len = std::max(max_len, p.seq(n).length);
  auto chunks =
      attnmix::detail::cpu::path_prepare<float>(a.k, a.w, a.beta, p, 64, attnmix::backend::cpu{0});
  cu::path_shape shape;
  shape.batch = p.batch, shape.tokens = p.tokens, shape.head_dim = p.head_dim,
  shape.value_dim = p.value_dim, shape.max_len = max_len, shape.q_heads = p.q_heads,
  shape.kv_heads = p.kv_heads, shape.sequences = p.num_sequences;
  cu::device_properties props;
  props.sms = sms, props.smem_per_block_optin = 227 * 1024;
  const cu::path_backward_plan plan = cu::plan_path_backward(shape, gated, props);
  std::vector<double> scratch_d(plan.scratch_bytes / 8 + 1);
  unsigned char* base = reinterpret_cast<unsigned char*>(scratch_d.data());
  std::memset(base, 0x7f, plan.scratch_bytes);  // garbage
  const cu::path_backward_layout& l = plan.layout;
  cu::path_backward_params bp{};
  cu::path_kernel_params& kp = bp.kp;
  auto cp = [](index_t(&to)[3], const auto& v) {
    for (int i = 0; i < 3; ++i) to[i] = v.stride(i);
  };
  kp.a.q = a.q.data(), kp.a.k = a.k.data(), kp.a.v = a.v.data();
  cp(kp.a.q_stride, a.q), cp(kp.a.k_stride, a.k), cp(kp.a.v_stride, a.v);
  kp.a.cu_seqlens = p.cu_seqlens;
  kp.a.tokens = p.tokens;
  kp.a.q_heads = int(p.q_heads), kp.a.group = int(p.group());
  kp.a.head_dim = int(p.head_dim), kp.a.value_dim = int(p.value_dim);
  kp.w = a.w.data(), kp.beta = a.beta.data();
  cp(kp.w_stride, a.w), cp(kp.beta_stride, a.beta);
  kp.kv_heads = int(p.kv_heads);
  kp.kt = chunks.kt.data(), kp.u = chunks.u.data(), kp.m = chunks.m.data();
  bp.out = a.out.data(), bp.dout = a.dout.data(), bp.lse = a.lse.data();
  bp.dq = a.dq.data(), bp.dk = a.dk.data(), bp.dv = a.dv.data();
  bp.dw = a.dw.data(), bp.dbeta = a.dbeta.data();
  cp(bp.out_stride, a.out), cp(bp.dout_stride, a.dout), cp(bp.lse_stride, a.lse);
  cp(bp.dq_stride, a.dq), cp(bp.dk_stride, a.dk), cp(bp.dv_stride, a.dv);
  cp(bp.dw_stride, a.dw), cp(bp.dbeta_stride, a.dbeta);
  bp.scale = float(p.scale);
  bp.slices = plan.slices;
  auto floats = [&](std::size_t at) {
    return reinterpret_cast<float*>(base + at);
  };
  bp.dkt = floats(l.dkt), bp.dws = floats(l.dw), bp.dus = floats(l.du);
  bp.states = floats(l.states), bp.e = floats(l.e), bp.dvs = floats(l.dv);
  bp.dk_diag = floats(l.dk), bp.dm = floats(l.dm);
  bp.slice_d = index_t(l.slice_d / 4), bp.slice_dv = index_t(l.slice_dv / 4);
  std::memset(base + l.zeroed, 0, l.zeroed_bytes);
  if (gated) {
    auto* G = reinterpret_cast<double*>(base + l.gate);
    auto* reset = reinterpret_cast<std::int32_t*>(base + l.reset);
    blockDim.x = 128;
    for (unsigned y = 0; y < plan.gate_grid.y; ++y)
      for (unsigned x = 0; x < plan.gate_grid.x; ++x)
        for (unsigned th = 0; th < 128; ++th) {
          blockIdx = {x, y, 0}, threadIdx = {th, 0, 0};
          cu::path_backward_gate_kernel(a.g.data(), a.g.stride(0), a.g.stride(1), a.g.stride(2),
                                        kp.a, G, reset);
        }
    bp.G = G, bp.reset = reset, bp.coef = attnmix::detail::gate_coefficient<Policy>(p);
    bp.dgate = reinterpret_cast<double*>(base + l.dgate);
    bp.slice_gate = index_t(l.slice_gate / 8);
  }
  threadIdx = {0, 0, 0}, blockDim = {1, 1, 1};
  emu_smem_buf.assign(plan.query_smem / 4 + 16, NAN);
  for (unsigned z = 0; z < plan.query_grid.z; ++z)
    for (unsigned y = 0; y < plan.query_grid.y; ++y)
      for (unsigned x = 0; x < plan.query_grid.x; ++x) {
        blockIdx = {x, y, z};
        cu::path_backward_query_kernel<float>(bp);
      }
  emu_smem_buf.assign(plan.chunk_smem / 4 + 16, NAN);
  for (unsigned z = 0; z < plan.chunk_grid.z; ++z)
    for (unsigned y = 0; y < plan.chunk_grid.y; ++y)
      for (unsigned x = 0; x < plan.chunk_grid.x; ++x) {
        blockIdx = {x, y, z};
        cu::path_backward_chunk_kernel<float>(bp);
      }
  if (gated) {
    blockDim.x = 128;
    for (unsigned y = 0; y < plan.gate_grid.y; ++y)
      for (unsigned x = 0; x < plan.gate_grid.x; ++x)
        for (unsigned th = 0; th < 128; ++th) {
          blockIdx = {x, y, 0}, threadIdx = {th, 0, 0};
          cu::path_backward_dg_kernel(a.g.data(), a.g.stride(0), a.g.stride(1), a.g.stride(2), kp.a,
                                      bp.dgate, bp.slice_gate, bp.slices, a.dg.data(),
                                      a.dg.stride(0), a.dg.stride(1), a.dg.stride(2));
        }
  }
  grads got{to_double(dq.storage()), to_double(dk.storage()),    to_double(dv.storage()),
            to_double(dw.storage()), to_double(dbeta.storage()), to_double(dg.storage())};
  const double e[6] = {max_rel(got.dq, ref.dq),       max_rel(got.dk, ref.dk),
                       max_rel(got.dv, ref.dv),       max_rel(got.dw, ref.dw),
                       max_rel(got.dbeta, ref.dbeta), gated ? max_rel(got.dg, ref.dg) : 0.0};
  bool ok = true;
  for (double x : e) ok = ok && x <= 1e-5;
  std::printf(
      "%s %s slices=%d kind=%s resets=%zu: dq %.9e dk %.9e dv %.9e dw %.9e dbeta %.9e dg %.9e\n",
      ok ? "ok  " : "FAIL", c.describe().c_str(), plan.slices, Kind::name, g_inf.size(), e[0], e[1],
      e[2], e[3], e[4], e[5]);
  return ok;
}

int main() {
  using attnmix::kind::path;
  using attnmix::kind::path_fox;
  using after =
      attnmix::with_gate_scaling<attnmix::path_fox_policy, attnmix::gate_scaling::after_scale>;
  std::vector<path_case> cases = {{1, 1, 1, 1, 64, 64},
                                  {1, 5, 1, 1, 64, 64},
                                  {1, 64, 1, 1, 64, 64},
                                  {1, 65, 1, 1, 64, 64},
                                  {1, 65, 4, 2, 64, 64},
                                  {2, 200, 4, 2, 64, 64},
                                  {1, 200, 2, 2, 64, 64, {}, beta_range::near_two},
                                  {1, 200, 2, 1, 64, 64, {0, 0, 1, 64, 130, 200}},
                                  {1, 130, 2, 1, 128, 128},
                                  {1, 100, 2, 2, 40, 24},
                                  {1, 1100, 2, 1, 64, 64}};
  bool ok = true;
  std::uint64_t salt = 1;
  for (const auto& c : cases) {
    ok &= run_case<path, attnmix::path_policy>(c, ++salt, {}, 132);
    ok &= run_case<path_fox, attnmix::path_fox_policy>(c, ++salt, {}, 132);
    ok &= run_case<path_fox, after>(c, ++salt, {}, 132);
  }
  ok &= run_case<path_fox, attnmix::path_fox_policy>(
      {1, 200, 2, 1, 64, 64, {}, beta_range::near_two}, 90, {0, 17, 64, 65, 199}, 132);
  ok &= run_case<path_fox, attnmix::path_fox_policy>({1, 200, 2, 1, 64, 64, {0, 0, 1, 70, 200}}, 91,
                                                     {5, 100}, 132);
  // One SM: 1 slice; many: slices up to 8 at long T.
  ok &= run_case<path_fox, attnmix::path_fox_policy>({1, 2100, 2, 1, 32, 16}, 92, {}, 1);
  ok &= run_case<path_fox, attnmix::path_fox_policy>({1, 2100, 2, 1, 32, 16}, 93, {300}, 132);
  std::printf(ok ? "ALL OK\n" : "SOME FAILED\n");
  return ok ? 0 : 1;
}
