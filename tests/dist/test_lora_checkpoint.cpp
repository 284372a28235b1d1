// A LoRA model in a checkpoint: the model's state dict holds the adapters by slot and the merged
// ones inside the base weights; LoraModel's table says which adapter each slot holds and what is
// merged. A resume into adapters added in another order, or a load of a merged checkpoint into
// an unmerged model, must give back the saved model, on any mesh.
#include <gtest/gtest.h>

#include <cmath>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const LoraSlots kSlots{2, 4};

// "default": every projection, dropout 0.1; "b": wq and wv only, another rank, scale and seed.
LoraConfig config_a() {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.lora_dropout = 0.1;
  return c;
}

LoraConfig config_b() {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.r = 2;
  c.lora_alpha = 3;
  c.lora_dropout = 0.2;
  c.target_modules = {"wq", "wv"};
  c.seed = 11;
  return c;
}

StateDict train_state(LoraRun& run, Optimizer& opt) {
  StateDict sd;
  insert_state_dict(sd, "model", get_model_state_dict(*run.model));
  insert_state_dict(sd, "optim", get_optimizer_state_dict(*run.model, opt));
  insert_state_dict(sd, "lora", run.lora->state_dict());
  return sd;
}

std::vector<double> train(LoraRun& run, Optimizer& opt, int first, int steps) {
  std::vector<double> losses;
  for (int s = first; s < first + steps; ++s)
    losses.push_back(lora_train_step(run, opt, s));
  return losses;
}

Tensor eval_logits(LoraRun& run) {
  const DecoderConfig cfg = lora_decoder_config();
  Batch b = affine_batch(99, 8, cfg.max_seq_len, cfg.vocab_size);
  NoGradGuard no_grad;
  run.model->eval();
  Tensor out = run.logits(b.ids).contiguous();
  run.model->train();
  return out;
}

}  // namespace

// Saved with "default" in slot 0 and "b" (active) in slot 1, after steps with each and dropout
// on; resumed into a model whose adapters sit the other way round, one under another name. The
// table puts each adapter back in its slot with its config and dropout stream, and training goes on
// bit for bit. Without the table the same values load under the wrong adapters, and the losses
// differ.
TEST(LoraCheckpoint, ResumeRestoresEachAdapterToItsSlot) {
  const std::string dir = scratch_dir("lora_checkpoint_resume");
  for (const LoraLayout& l : lora_layouts(kSlots)) {
    SCOPED_TRACE(l.name);
    const std::string path = dir + "/ckpt.h5";
    LoraRun run = l.build(lora_decoder_config(), config_a());
    run.lora->add_adapter("b", config_b());
    AdamW opt(run.lora->parameters(), {3e-3});
    train(run, opt, 0, 2);
    run.lora->set_adapter("b");
    train(run, opt, 2, 2);
    save(train_state(run, opt), path);
    std::vector<double> want = train(run, opt, 4, 3);
    run.lora->set_adapter("default");  // its dropout streams were saved too
    want.push_back(train(run, opt, 7, 1)[0]);

    auto resume = [&](bool with_table) {
      // Slot 0 holds "y" (b's config), slot 1 "default"; there is no "b".
      LoraRun again = l.build(lora_decoder_config(), config_a());
      again.lora->delete_adapter("default");
      again.lora->add_adapter("y", config_b());
      again.lora->add_adapter("default", config_a());
      // Slot 0 active, and a mixed batch of slot 0: the table must undo both.
      again.lora->set_adapter("y");
      const int64_t rows = 8 / again.dp_size;
      again.lora->set_batch_adapters(
          full({rows}, double(again.lora->adapter_id("y")), DType::Int64));
      AdamW opt2(again.lora->parameters(), {3e-3});
      StateDict sd = train_state(again, opt2);
      load(sd, path);
      set_optimizer_state_dict(*again.model, opt2, sub_state_dict(sd, "optim"));
      if (with_table) again.lora->load_state_dict(sub_state_dict(sd, "lora"));
      if (with_table) {
        EXPECT_EQ(again.lora->adapters(), (std::vector<std::string>{"default", "b"}));
        EXPECT_EQ(again.lora->active_adapter(), "b");
        EXPECT_EQ(again.lora->config("b").r, 2);
        EXPECT_EQ(again.lora->config("default").target_modules, config_a().target_modules);
      }
      std::vector<double> losses = train(again, opt2, 4, 3);
      again.lora->set_batch_adapters(Tensor());
      again.lora->set_adapter("default");
      losses.push_back(train(again, opt2, 7, 1)[0]);
      return losses;
    };
    const std::vector<double> got = resume(true);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_EQ(got[s], want[s]) << "step " << s;
    EXPECT_NE(resume(false)[0], want[0]) << "the table changed nothing: this test cannot fail";
  }
}

// Saved while merged (the base weights hold scale B A), loaded into a model that never merged:
// the table marks the adapter merged, so it applies once, and unmerging gives the unmerged model
// back. From every layout of this world size into its first and its last.
TEST(LoraCheckpoint, MergedCheckpointAppliesTheAdapterOnce) {
  const std::string dir = scratch_dir("lora_checkpoint_merged");
  const std::vector<LoraLayout> layouts = lora_layouts(kSlots);
  for (const LoraLayout& from : layouts)
    for (const LoraLayout& to : {layouts.front(), layouts.back()}) {
      SCOPED_TRACE(from.name + " -> " + to.name);
      const std::string path = dir + "/merged.h5";
      LoraRun run = from.build(lora_decoder_config(), lora_test_config(LoraInit::Random));
      const Tensor unmerged = eval_logits(run);
      run.lora->merge_adapter("default");
      const Tensor merged = eval_logits(run);
      save_lora_checkpoint(run, path);

      LoraRun fresh = to.build(lora_decoder_config(), lora_test_config(LoraInit::Kaiming));
      const Tensor base = eval_logits(fresh);  // Kaiming: B is zero, the adapter adds nothing
      StateDict in;
      insert_state_dict(in, "model", get_model_state_dict(*fresh.model));
      insert_state_dict(in, "lora", fresh.lora->state_dict());
      load(in, path);
      // Before the table: the merged weights and the adapter again, applied twice.
      EXPECT_GT(max_abs_diff(eval_logits(fresh), merged), 1e-3);
      fresh.lora->load_state_dict(sub_state_dict(in, "lora"));
      EXPECT_LE(max_abs_diff(eval_logits(fresh), merged), 1e-5);
      fresh.lora->unmerge_adapter("default");
      EXPECT_LE(max_abs_diff(eval_logits(fresh), unmerged), 1e-5);
      EXPECT_GT(max_abs_diff(unmerged, base), 1e-3);
    }
}

// A table that does not fit this model is refused, naming why, and leaves the model's adapters
// as they were.
TEST(LoraCheckpoint, TableThatDoesNotFitIsRefused) {
  LoraRun run = lora_layouts(kSlots).back().build(lora_decoder_config(), config_a());
  run.lora->add_adapter("b", config_b());
  const StateDict good = run.lora->state_dict();
  const std::string text = std::get<std::string>(good.at("adapters"));

  auto expect_refused = [&](const StateDict& sd, const std::string& needle) {
    const std::string err = error_of([&] { run.lora->load_state_dict(sd); });
    EXPECT_NE(err.find(needle), std::string::npos) << err;
    EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default", "b"}));
    EXPECT_EQ(run.lora->active_adapter(), "default");
    EXPECT_EQ(run.lora->adapter_id("b"), 1);
    for (const auto& [path, layer] : run.lora->layers())
      EXPECT_EQ(layer->slot(0).adapter, "default") << path;
  };
  // The table with the first (or last) `from` replaced by `to`.
  auto with = [&](const std::string& from, const std::string& to, bool last = false) {
    std::string t = text;
    const size_t at = last ? t.rfind(from) : t.find(from);
    EXPECT_NE(at, std::string::npos) << from << " in " << t;
    if (at != std::string::npos) t.replace(at, from.size(), to);
    return StateDict{{"adapters", t}};
  };
  expect_refused({}, "has no string 'adapters'");
  expect_refused({{"adapters", int64_t(3)}}, "int64 3");
  expect_refused({{"adapters", std::string("{not json")}}, "is not JSON");
  expect_refused({{"adapters", std::string("[]")}}, "is not a JSON object");
  expect_refused(with("\"slot\":1", "\"slot\":18446744073709551615"),
                 "'slot' is 18446744073709551615, not an int64 integer");
  expect_refused(with("\"max_adapters\":2", "\"max_adapters\":3"), "3 adapter slots of rank 4");
  expect_refused(with("\"slot\":1", "\"slot\":0"), "slot 0 is out of range or taken");
  expect_refused(with("\"wv\"]", "\"w1\"]"), "saved only: layers.0.attention.wv");
  expect_refused(with("\"merged\":false", "\"merged\":true", /*last=*/true),
                 "is merged but not active");
  expect_refused(with("\"r\":2", "\"r\":5"), "exceeds the slots' rank 4");
  expect_refused(with("\"format\":1", "\"format\":5"), "has format 5; this build reads 1 to 4");
  expect_refused(with("\"lora_alpha\":3.0", "\"lora_alpha\":\"3\""),
                 "'lora_alpha' is \"3\", not a number");
  expect_refused(with("\"active_adapter\":\"default\"", "\"active_adapter\":\"c\""),
                 "the active adapter 'c' is not in the table");
  if (world_size() > 1) {
    const StateDict mine = world_rank() == 1 ? with("\"seed\":11", "\"seed\":12") : good;
    expect_refused(mine, "rank 1 passed another table than rank 0");
  }
  // The dict as given loads.
  run.lora->set_adapter("b");
  run.lora->load_state_dict(good);
  EXPECT_EQ(run.lora->active_adapter(), "default");
}
