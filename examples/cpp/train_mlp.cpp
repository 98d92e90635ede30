// A small MLP trained data-parallel with RaggedFSDP from C++ alone: the model is
// libtorch's torch::nn, its parameters live in one FSDPUnit sharded over the
// ranks torchrun starts (a Gloo group from the environment), and AdamW8bit or
// Muon steps each rank's shards.
//
//   torchrun --nproc_per_node 2 --no-python ./train_mlp --optimizer adamw8bit --steps 300
//
// Every rank builds the same model and data from --seed; rank r trains on its
// part of each batch, gradients are averaged across ranks, and rank 0 prints the
// loss of the whole batch (the average of the ranks' losses). --shard-size M
// (HSDP): shard over groups of M ranks, replicate across the world / M groups.
// --device cuda: each rank on GPU LOCAL_RANK over NCCL (the unit's collectives on
// side streams, the optimizers on the GPU); the default is the CPU over Gloo.
// --comm int8 | float8_e4m3fn: the weights gathered as 8-bit block codes;
// --grad-comm bf16: gradients sent in bf16 and summed in fp32 (rfsdp::CommPolicy).
#include <torch/torch.h>

#include <rfsdp/core/comm/comm.h>
#include <rfsdp/core/comm/hybrid_groups.h>
#include <rfsdp/core/ragged/planner.h>
#include <rfsdp/fsdp/fsdp_unit.h>
#include <rfsdp/optimizers/adamw/adamw.h>
#include <rfsdp/optimizers/common/param_shard.h>
#include <rfsdp/optimizers/muon/muon.h>
#include <rfsdp/quant/ops.h>
#include <rfsdp/rfsdp_version.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string optimizer = "adamw8bit";  // or "muon" (matrices; AdamW for the biases)
  int steps = 300, batch = 64, in = 32, hidden = 256, out = 16, seed = 0, log_every = 25;
  int shard_size = 0;  // 0: shard over every rank (plain FSDP)
  std::string device = "cpu";  // or "cuda"
  std::string comm = "full";   // the weights' all-gather: full, int8 or float8_e4m3fn codes
  std::string grad_comm = "fp32";  // the gradients' reduce: fp32, or bf16 summed in fp32
  double lr = -1;  // default per optimizer
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--optimizer") a.optimizer = value();
    else if (k == "--steps") a.steps = std::stoi(value());
    else if (k == "--batch") a.batch = std::stoi(value());
    else if (k == "--hidden") a.hidden = std::stoi(value());
    else if (k == "--seed") a.seed = std::stoi(value());
    else if (k == "--lr") a.lr = std::stod(value());
    else if (k == "--log-every") a.log_every = std::stoi(value());
    else if (k == "--shard-size") a.shard_size = std::stoi(value());
    else if (k == "--device") a.device = value();
    else if (k == "--comm") a.comm = value();
    else if (k == "--grad-comm") a.grad_comm = value();
    else throw std::invalid_argument("unknown option " + k);
  }
  if (a.optimizer != "adamw8bit" && a.optimizer != "muon") {
    throw std::invalid_argument("--optimizer must be adamw8bit or muon, got " + a.optimizer);
  }
  if (a.device != "cpu" && a.device != "cuda") {
    throw std::invalid_argument("--device must be cpu or cuda, got " + a.device);
  }
  if (a.lr < 0) a.lr = a.optimizer == "muon" ? 0.02 : 3e-3;
  return a;
}

int run(const Args& a) {
  // torchrun's MASTER_ADDR, RANK, WORLD_SIZE (and LOCAL_RANK: the GPU NCCL uses).
  auto comm = rfsdp::Comm::from_env(rfsdp::Comm::kDefaultTimeout,
                                    a.device == "cuda" ? "nccl" : "gloo");
  const at::Device device = a.device == "cuda" ? comm->control_device() : at::Device(at::kCPU);
  const int rank = comm->rank(), world = comm->size();
  if (a.batch % world != 0) throw std::invalid_argument("--batch must divide among the ranks");

  // The same model and data on every rank: one seed, drawn in a fixed order.
  torch::manual_seed(a.seed);
  // (layer by layer: the order of a call's arguments is unspecified, the draws' is not)
  torch::nn::Linear first(a.in, a.hidden);
  torch::nn::Linear second(a.hidden, a.out);
  torch::nn::Sequential model(first, torch::nn::Tanh(), second);
  const at::Tensor teacher = torch::randn({a.in, a.out}) * (1.0 / std::sqrt(double(a.in)));
  const at::Tensor xs = torch::randn({a.steps, a.batch, a.in}).to(device);
  const at::Tensor ys = torch::sin(torch::matmul(xs, teacher.to(device)));
  model->to(device);

  // One unit holds every parameter. Granules: whole matrices for Muon, whole
  // 8-bit blocks for AdamW8bit, so no rank boundary cuts what the optimizer needs.
  const auto block = rfsdp::quant::BlockShape::blocks(256);
  std::vector<at::Tensor> params;
  std::vector<rfsdp::TensorSpec> specs;
  for (const auto& item : model->named_parameters()) {
    rfsdp::TensorSpec t;
    t.name = item.key();
    t.shape = item.value().sizes().vec();
    const bool matrix = t.shape.size() == 2;
    t.granule_rows = a.optimizer == "muon" && matrix ? rfsdp::kWholeTensor
                                                      : block.granule_rows(t.row_elems());
    specs.push_back(t);
    params.push_back(item.value());
  }
  // HSDP: the unit is planned for, gathered and reduce-scattered in the shard
  // group, and its gradients all-reduced across the replica group. Optimizers
  // work in the shard group (each replica computes the same update).
  const rfsdp::HybridGroups groups =
      a.shard_size > 0 ? rfsdp::hybrid_groups(*comm, a.shard_size) : rfsdp::HybridGroups{comm, {}};
  const auto& shard_comm = groups.shard;
  // The communication policy: weight codes in the 8-bit blocks the plan keeps whole
  // (the unit refuses a plan that cuts them), gradients in bf16 summed in fp32.
  if (a.grad_comm != "fp32" && a.grad_comm != "bf16") {
    throw std::invalid_argument("--grad-comm must be fp32 or bf16, got " + a.grad_comm);
  }
  const rfsdp::CommPolicy comm_policy = rfsdp::CommPolicy::parse(
      a.comm, block.block,
      a.grad_comm == "bf16" ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
  rfsdp::FSDPUnit unit(shard_comm, groups.replicate, rfsdp::plan_unit(specs, shard_comm->size()),
                       rfsdp::MixedPrecision{}, comm_policy, device);
  {
    torch::NoGradGuard no_grad;
    unit.shard(params);
  }
  const std::vector<rfsdp::ParamShard> shards = rfsdp::param_shards(unit);

  // AdamW8bit; or Muon for the matrices with AdamW for the rest (biases), one
  // optimizer, one step and one agreement all-reduce for both.
  std::unique_ptr<rfsdp::ShardedOptimizer> opt;
  if (a.optimizer == "adamw8bit") {
    rfsdp::AdamWOptions adamw;
    adamw.lr = a.lr;
    adamw.weight_decay = 0.0;
    rfsdp::AdamW8bitConfig config;
    config.block = block;
    opt = std::make_unique<rfsdp::AdamW8bit>(shards, adamw, config, shard_comm);
  } else {
    std::vector<bool> use_muon;
    std::vector<size_t> group_of;
    for (const auto& s : shards) {
      use_muon.push_back(s.shape.size() == 2);
      group_of.push_back(s.shape.size() == 2 ? 0 : 1);
    }
    rfsdp::MuonOptions mo;
    mo.lr = a.lr;
    auto muon = std::make_unique<rfsdp::Muon>(shards, mo, rfsdp::MuonConfig{}, shard_comm,
                                              std::vector<int>{}, use_muon);
    muon->set_groups(group_of);
    rfsdp::MuonOptions rest = mo;  // the AdamW part's group
    rest.lr = 3e-3;
    rest.adam_beta1 = 0.9;
    rest.adam_beta2 = 0.999;
    rest.adam_eps = 1e-8;
    muon->set_group_options(1, rest);
    opt = std::move(muon);
  }

  const int local = a.batch / world;
  for (int step = 0; step < a.steps; ++step) {
    // Gather the parameters; the module computes with views of the gathered buffer,
    // and its gradients accumulate into the unit's gradient buffer.
    unit.unshard().wait();
    unit.prepare_grads();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_data(unit.full_param(i));
      params[i].mutable_grad() = unit.full_grad(i);
    }
    const at::Tensor x = xs[step].narrow(0, rank * local, local);
    const at::Tensor y = ys[step].narrow(0, rank * local, local);
    const at::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    unit.reduce_grads(rfsdp::ReduceOp::Avg).wait();  // this rank's rows of the mean gradient
    unit.reshard();
    opt->step();
    unit.zero_grad();  // the local gradient slice accumulates until zeroed
    at::Tensor total = loss.detach().clone();
    comm->all_reduce(total, rfsdp::ReduceOp::Avg).wait();
    if (rank == 0 && (step % a.log_every == 0 || step == a.steps - 1)) {
      std::printf("step %4d loss %.9e\n", step, total.item<double>());
    }
  }
  if (rank == 0) {
    std::printf("RaggedFSDP %s, %d ranks (%d-rank shard groups) on %s, %s: S = %lld elements "
                "per rank\n", RFSDP_VERSION, world, shard_comm->size(), device.str().c_str(),
                a.optimizer.c_str(), static_cast<long long>(unit.plan().shard_elems));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return 1;
  }
}
