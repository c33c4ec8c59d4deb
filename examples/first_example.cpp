// The README's first example, built and run by CI so that it stays true.
#include <attnmix/attnmix.hpp>

int main() {
  attnmix::host_tensor<float, 4> q({1, 128, 8, 64}), k({1, 128, 2, 64}), v({1, 128, 2, 64});
  attnmix::host_tensor<float, 4> out({1, 128, 8, 64});          // [B, T, HQ, Dv]
  attnmix::host_tensor<float, 3> g({1, 128, 8}, -0.05f);         // log forget gate [B, T, HQ]
  attnmix::attention_args<float> args{q.view(), k.view(), v.view(), out.view()};
  attnmix::attention<attnmix::kind::softmax>(args);              // causal SA, GQA 8:2
  args.g = g.view();
  attnmix::attention<attnmix::kind::fox>(args);                  // FoX
}
