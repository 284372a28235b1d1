// A program outside the Tessera tree: one header, one target.
#include <tessera/tessera.h>

#include <cstdio>

int main(int argc, char** argv) {
  tessera::Runtime runtime(argc, argv);
  tessera::Tensor x = tessera::ones({2, 3}).set_requires_grad(true);
  tessera::Tensor loss = tessera::sum(tessera::mul(x, x));
  tessera::backward(loss);
  tessera::DeviceMesh mesh({tessera::world_size()});
  tessera::DTensor d = tessera::distribute_tensor(x.detach(), mesh, {tessera::Shard(0)});
  bool ok = loss.item<float>() == 6.0f && x.grad().to_vector<float>()[0] == 2.0f &&
            d.full_tensor().numel() == 6;
  std::printf("consumer %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
