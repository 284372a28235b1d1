// A two-layer MLP learning to classify points of a generated spiral data set, on one process.
// Shows the tensor core and autograd end to end: shard-invariant init, forward, cross-entropy,
// backward, and an SGD update done with raw kernels under NoGradGuard.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cli.h"
#include "tessera/tessera.h"

using namespace tessera;

namespace {

// `classes` interleaved spiral arms with a little noise: not linearly separable.
void make_spirals(int64_t n_per_class, int64_t classes, Generator& gen, Tensor& x, Tensor& y) {
  const int64_t n = n_per_class * classes;
  x = empty({n, 2});
  y = empty({n}, DType::Int64);
  Tensor noise = randn({n, 2}, gen);
  const float* e = noise.data<float>();
  float* xp = x.data<float>();
  int64_t* yp = y.data<int64_t>();
  for (int64_t c = 0; c < classes; ++c) {
    for (int64_t i = 0; i < n_per_class; ++i) {
      const int64_t k = c * n_per_class + i;
      const double r = double(i) / double(n_per_class);
      const double t = 4.0 * r + 2.0 * M_PI * double(c) / double(classes);
      xp[2 * k] = float(r * std::cos(t) + 0.03 * e[2 * k]);
      xp[2 * k + 1] = float(r * std::sin(t) + 0.03 * e[2 * k + 1]);
      yp[k] = c;
    }
  }
}

Tensor parameter(const Shape& shape, Generator& gen, bool bias) {
  Tensor p = empty(shape);
  if (bias) {
    p.zero_();
  } else {
    kaiming_uniform_(p, gen, std::sqrt(5.0));  // nn.Linear's initialisation
  }
  return p.set_requires_grad(true);
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage = "usage: train_mlp [STEPS]  (default 300)\n";
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::fputs(usage, stdout);
    return 0;
  }
  int steps = 300;
  try {
    if (argc > 2) throw std::invalid_argument("train_mlp: too many arguments");
    if (argc == 2) steps = int(cli::parse_int("train_mlp: STEPS", argv[1], 1, 1 << 30));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n%s", e.what(), usage);
    return 2;
  }
  const int64_t hidden = 64, classes = 3;
  Generator gen(2026);
  Tensor x, y;
  make_spirals(200, classes, gen, x, y);

  std::vector<Tensor> params = {
      parameter({hidden, 2}, gen, false),       parameter({hidden}, gen, true),
      parameter({hidden, hidden}, gen, false),  parameter({hidden}, gen, true),
      parameter({classes, hidden}, gen, false), parameter({classes}, gen, true)};
  const double lr = 0.5, momentum = 0.9;
  std::vector<Tensor> velocity;
  for (const Tensor& p : params)
    velocity.push_back(zeros_like(p));

  double first = 0, last = 0;
  for (int step = 0; step <= steps; ++step) {
    Tensor h = relu(linear(x, params[0], params[1]));
    h = relu(linear(h, params[2], params[3]));
    Tensor loss = cross_entropy(linear(h, params[4], params[5]), y);
    backward(loss);
    {
      NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        // v = momentum * v + g;  p -= lr * v
        kernels::mul_scalar_(velocity[i], momentum);
        kernels::add_(velocity[i], params[i].grad());
        kernels::add_(params[i], velocity[i], -lr);
        params[i].set_grad(Tensor());
      }
    }
    last = loss.item<float>();
    if (step == 0) first = last;
    if (step % 25 == 0) std::printf("step %4d  loss %.4f\n", step, last);
  }
  std::printf("loss %.4f -> %.4f over %d steps\n", first, last, steps);
  return last < 0.5 * first ? 0 : 1;
}
