// Softmax attention on a tiny input; exits non-zero unless the output is a convex combination
// of the values.
#include <attnmix/attnmix.hpp>

#include <cmath>
#include <cstdio>

int main() {
  attnmix::host_tensor<float, 4> q({1, 3, 1, 2}, 0.5f), k({1, 3, 1, 2}, 0.25f);
  attnmix::host_tensor<float, 4> v({1, 3, 1, 1}), out({1, 3, 1, 1});
  for (int t = 0; t < 3; ++t) v(0, t, 0, 0) = float(t);
  attnmix::attention<attnmix::kind::softmax>(
      attnmix::attention_args<float>{q.view(), k.view(), v.view(), out.view()});
  // Equal scores: the causal mean of 0, 1, 2 up to each position.
  bool ok = true;
  for (int t = 0; t < 3; ++t) ok = ok && std::fabs(out(0, t, 0, 0) - 0.5f * t) < 1e-6f;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong output");
  return ok ? 0 : 1;
}
