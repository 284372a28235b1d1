// Save on any mesh, load on any other. The Save stage runs at every world size (a ctest fixture):
// each decoder layout of that world trains a few steps, saves model + optimizer, then goes on
// training and records the losses of the uninterrupted run. The Load stage, at every world size,
// loads every checkpoint of every world into every layout of its own: the loaded values must be
// bit-identical to the file, and training resumed from them must give the uninterrupted losses
// (bitwise on the saving layout, within 1e-6 relative on any other).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "dist/checkpoint_models.h"
#include "dist/checkpoint_util.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int kBefore = 3;  // steps before the checkpoint
constexpr int kAfter = 3;   // steps after it

StateDict train_state(Parallel& p, AdamW& opt) {
  StateDict sd;
  insert_state_dict(sd, "model", get_model_state_dict(*p.model));
  insert_state_dict(sd, "optim", get_optimizer_state_dict(*p.model, opt));
  sd["extras/step"] = int64_t(0);
  return sd;
}

std::string data_dir() {
  return shared_scratch_dir("reshard");
}

}  // namespace

TEST(CheckpointReshard, Save) {
  const std::string dir = data_dir();
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    AdamW opt(p.model->parameters(), checkpoint_adamw());
    for (int s = 0; s < kBefore; ++s)
      train_step(p, opt, s);
    StateDict sd = train_state(p, opt);
    sd["extras/step"] = int64_t(kBefore);
    save(sd, dir + "/" + l.name + ".h5");
    std::vector<double> losses;
    for (int s = kBefore; s < kBefore + kAfter; ++s)
      losses.push_back(train_step(p, opt, s));
    save({{"losses", from_vector<double>(losses)}}, dir + "/" + l.name + ".losses");
  }
}

TEST(CheckpointReshard, Load) {
  const std::string dir = data_dir();
  std::vector<std::string> saved;
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (f.path().extension() == ".h5") saved.push_back(f.path().stem().string());
  std::sort(saved.begin(), saved.end());
  // Every world size's Save stage ran first (ctest fixture): 1 + 2 + 4 + 3 layouts.
  EXPECT_EQ(saved.size(), 10u);
  double worst = 0;
  for (const std::string& from : saved) {
    const std::string path = dir + "/" + from + ".h5";
    const std::vector<double> want =
        read_checkpoint_tensor(dir + "/" + from + ".losses", "losses").to_vector<double>();
    for (const Layout& l : decoder_layouts()) {
      const std::string what = from + " -> " + l.name;
      Parallel p = l.build(99);  // other initial values: everything must come from the file
      AdamW opt(p.model->parameters(), checkpoint_adamw());
      StateDict sd = train_state(p, opt);
      const IncompatibleKeys k = load(sd, path);
      ASSERT_TRUE(k.empty()) << what << ": " << k.str();
      set_optimizer_state_dict(*p.model, opt, sub_state_dict(sd, "optim"));
      ASSERT_EQ(std::get<int64_t>(sd.at("extras/step")), kBefore) << what;
      for (const auto& [key, v] : sd) {
        if (!std::holds_alternative<DTensor>(v) && !std::holds_alternative<Tensor>(v)) continue;
        const Tensor got = std::holds_alternative<DTensor>(v) ? std::get<DTensor>(v).full_tensor()
                                                              : std::get<Tensor>(v);
        if (world_rank() == 0)
          expect_identical(got, read_checkpoint_tensor(path, key), what + " " + key);
      }
      for (int s = kBefore; s < kBefore + kAfter; ++s) {
        const double loss = train_step(p, opt, s);
        const double w = want[size_t(s - kBefore)];
        if (from == l.name)
          EXPECT_EQ(loss, w) << what << " step " << s << ": resumed on the saving layout";
        else
          EXPECT_NEAR(loss, w, 1e-6 * std::abs(w)) << what << " step " << s;
        worst = std::max(worst, std::abs(loss - w) / std::abs(w));
      }
    }
  }
  if (world_rank() == 0)
    std::printf("[resume] %zu checkpoints into %zu layouts: worst relative loss difference %.2e\n",
                saved.size(), decoder_layouts().size(), worst);
}
