// rfsdp._C: optimizers/ (the C++ optimizers over this rank's shards, and the tiles).
#include "python/bindings/bindings.h"

#include <array>
#include <tuple>

#include "optimizers/adamw/adamw.h"
#include "optimizers/common/tiles.h"
#include "optimizers/muon/muon.h"
#include "optimizers/shampoo/shampoo.h"
#include "optimizers/soap/soap.h"

namespace rfsdp_bind {

namespace {

// The typed configs' glue: Python's values as the C++ settings take them, each
// error naming the argument (`who`: the optimizer). The values' checks are the
// library's (check_config).

// A storage dtype: a torch.dtype, its name as a checkpoint keeps it ("float32"),
// or one of the code names: "int8" (at::kByte) and, where `bits` is given,
// "int4" (bits 4; bits 8 for "int8"). None: `none`.
at::ScalarType dtype_arg(const py::object& v, const char* who, const char* arg,
                         const char* allowed, at::ScalarType none = at::kFloat, int* bits = nullptr) {
  if (bits) *bits = 0;
  if (v.is_none()) return none;
  if (py::isinstance<py::str>(v)) {
    const std::string name = v.cast<std::string>();
    if (name == "int8" || (bits && name == "int4")) {
      if (bits) *bits = name == "int8" ? 8 : 4;
      return at::kByte;
    }
    if (name == "float32" || name == "bfloat16" || name == "float16") return dtype_of(name);
  } else if (THPDtype_Check(v.ptr())) {
    return v.cast<at::ScalarType>();
  }
  throw std::invalid_argument(std::string(who) + ": " + arg + " must be " + allowed + ", got " +
                              py::repr(v).cast<std::string>());
}

// The low-bit basis settings Shampoo and SOAP share, from Python's arguments
// (bits: from basis_dtype).
rfsdp::quant::LowBitFormat basis_format(const char* who, int bits, const py::object& block,
                                        const std::string& map, const py::object& iterations) {
  rfsdp::quant::LowBitFormat f;
  f.bits = bits;
  f.block = int_arg(block, who, "basis_block");
  f.map = map;
  if (py::isinstance<py::bool_>(iterations) || !py::isinstance<py::int_>(iterations)) {
    throw std::invalid_argument(std::string(who) + ": bjorck_iterations must be an integer >= 0, got " +
                                py::repr(iterations).cast<std::string>());
  }
  f.bjorck_iterations = iterations.cast<int>();
  return f;
}

// Muon's ns_coefficients: None or "quintic" (the default), "polar_express", one
// (a, b, c) tuple (torch.optim.Muon's form: every iteration), or a list of them
// (one per iteration).
rfsdp::NsCoefficients ns_coefficients_arg(const py::object& v) {
  if (v.is_none()) return rfsdp::NsCoefficients::quintic();
  if (py::isinstance<py::str>(v)) {
    const std::string name = v.cast<std::string>();
    if (name == "quintic") return rfsdp::NsCoefficients::quintic();
    if (name == "polar_express") return rfsdp::NsCoefficients::polar_express();
  } else if (py::isinstance<py::sequence>(v) && py::len(v) > 0) {
    rfsdp::NsCoefficients c;
    const py::sequence seq = v.cast<py::sequence>();
    const bool one = !py::isinstance<py::sequence>(seq[0]);
    try {
      c.coefficients = one ? std::vector<std::array<double, 3>>{v.cast<std::array<double, 3>>()}
                           : v.cast<std::vector<std::array<double, 3>>>();
      return c;
    } catch (const py::cast_error&) {
    }
  }
  throw std::invalid_argument("Muon: ns_coefficients must be \"quintic\", \"polar_express\", one "
                              "(a, b, c) tuple or a list of them (one per iteration), got " +
                              py::repr(v).cast<std::string>());
}

// ns_coefficients as settings() keeps it: absent where quintic (the settings
// saved before it existed).
void put_ns_coefficients(py::dict& d, const rfsdp::NsCoefficients& c) {
  if (c == rfsdp::NsCoefficients::quintic()) return;
  if (c == rfsdp::NsCoefficients::polar_express()) {
    d["ns_coefficients"] = "polar_express";
    return;
  }
  py::list out;
  for (const auto& t : c.coefficients) out.append(py::make_tuple(t[0], t[1], t[2]));
  d["ns_coefficients"] = out;
}

void put_basis(py::dict& d, const rfsdp::quant::LowBitFormat& f) {
  d["basis_block"] = f.block;
  d["basis_map"] = f.map;
  d["bjorck_iterations"] = f.bjorck_iterations;
}

// The settings Shampoo and SOAP share (TiledConfig) from Python's arguments but
// the basis (basis_format: each reads basis_dtype its own way), and as
// settings() keeps them.
void set_tiled(rfsdp::TiledConfig& c, const char* who, const py::object& max_dim,
               const py::object& frequency, const py::object& factor_dtype) {
  c.max_preconditioner_dim = int_arg(max_dim, who, "max_preconditioner_dim");
  c.precondition_frequency = int_arg(frequency, who, "precondition_frequency");
  c.factor_dtype = dtype_arg(factor_dtype, who, "factor_dtype", "torch.float32 or torch.bfloat16");
}

// An 8-bit state's code format from Python: "dynamic" or "float8_e4m3fn".
rfsdp::quant::StateFormat state_format_arg(const py::object& x, const char* who) {
  if (!py::isinstance<py::str>(x)) {
    throw py::value_error(std::string(who) + ": state_format must be \"dynamic\" or "
                          "\"float8_e4m3fn\", got " + py::repr(x).cast<std::string>());
  }
  return rfsdp::quant::state_format(x.cast<std::string>());
}

// settings()' state_format, only where not the default: checkpoints saved before
// the setting existed (dynamic maps) keep loading as they are.
void put_state_format(py::dict& d, rfsdp::quant::StateFormat f) {
  if (f != rfsdp::quant::StateFormat::kDynamic) d["state_format"] = rfsdp::quant::state_format_name(f);
}

py::dict tiled_settings(const rfsdp::TiledConfig& c) {
  return py::dict(py::arg("max_preconditioner_dim") = c.max_preconditioner_dim,
                  py::arg("precondition_frequency") = c.precondition_frequency,
                  py::arg("factor_dtype") = dtype_name(c.factor_dtype));
}

// An optimizer's parameter from Python: its shard descriptor and this rank's tensor.
using ShardOf = std::pair<rfsdp::TensorShard, at::Tensor>;

std::vector<rfsdp::ParamShard> shards_of(const std::vector<ShardOf>& given) {
  std::vector<rfsdp::ParamShard> out;
  for (const auto& [shard, param] : given) out.emplace_back(shard, param);
  return out;
}

py::dict named(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  py::dict d;
  for (const auto& [name, t] : tensors) d[py::str(name)] = t;
  return d;
}

// A tiled optimizer (Shampoo, SOAP) with what both bind alike: construction,
// requantisation, group options and the tiles' counts.
template <class Optimizer, class Options, class Config>
py::class_<Optimizer, rfsdp::ShardedOptimizer, std::shared_ptr<Optimizer>> bind_tiled(py::module_& m,
                                                                                      const char* name) {
  return py::class_<Optimizer, rfsdp::ShardedOptimizer, std::shared_ptr<Optimizer>>(m, name)
      .def(py::init([](const std::vector<ShardOf>& params, const std::vector<bool>& precondition,
                       const Config& config, std::shared_ptr<rfsdp::Comm> comm) {
             auto shards = shards_of(params);
             py::gil_scoped_release release;  // collective (cut tiles' rows)
             return std::make_shared<Optimizer>(std::move(shards), Options{}, config, std::move(comm),
                                                precondition);
           }),
           py::arg("params"), py::arg("precondition"), py::arg("config"), py::arg("comm"))
      .def("requantized_state",
           [](const Optimizer& o, size_t i, const Config& saved, const rfsdp::NamedState& full) {
             return o.requantized_state(i, saved, full);
           },
           py::arg("i"), py::arg("saved"), py::arg("full"))
      .def("set_group_options", &Optimizer::set_group_options)
      .def("num_tiles", [](const Optimizer& o) { return o.tiles().size(); })
      .def("shared_tile_rows", [](const Optimizer& o) { return o.cut_rows().size(); })
      .def("fp64_retries", &Optimizer::fp64_retries);
}

}  // namespace

void bind_optimizers(py::module_& m) {
  // A group's hyperparameters (what a scheduler changes), as Python's param
  // groups name them (betas: a pair); the optimizer checks them when they are set.
  using Betas = std::pair<double, double>;
  py::class_<rfsdp::AdamWOptions>(m, "AdamWOptions")
      .def(py::init([](double lr, Betas betas, double eps, double weight_decay, bool hyperball,
                       const py::object& hyperball_radius) {
             rfsdp::AdamWOptions o;
             o.lr = lr, o.beta1 = betas.first, o.beta2 = betas.second, o.eps = eps;
             o.weight_decay = weight_decay;
             o.hyperball = hyperball;
             // (None: the parameter's norm when it first steps)
             o.hyperball_radius = hyperball_radius.is_none() ? 0.0 : hyperball_radius.cast<double>();
             return o;
           }),
           py::kw_only(), py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("hyperball") = false, py::arg("hyperball_radius") = py::none())
      .def("__eq__", [](const rfsdp::AdamWOptions& a, const rfsdp::AdamWOptions& b) {
             return std::tie(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.hyperball,
                             a.hyperball_radius) ==
                    std::tie(b.lr, b.beta1, b.beta2, b.eps, b.weight_decay, b.hyperball,
                             b.hyperball_radius);
           }, py::is_operator());
  py::class_<rfsdp::MuonOptions>(m, "MuonOptions")
      .def(py::init([](double lr, double momentum, double weight_decay, bool nesterov,
                       const std::string& adjust_lr, Betas betas, double eps, bool hyperball,
                       const py::object& hyperball_radius, double normuon_beta2,
                       double normuon_eps) {
             rfsdp::MuonOptions o{lr, momentum, weight_decay, nesterov,
                                  rfsdp::parse_muon_adjust_lr(adjust_lr), betas.first,
                                  betas.second, eps};
             o.hyperball = hyperball;
             // (None: the parameter's norm when it first steps)
             o.hyperball_radius = hyperball_radius.is_none() ? 0.0 : hyperball_radius.cast<double>();
             o.normuon_beta2 = normuon_beta2;
             o.normuon_eps = normuon_eps;
             return o;
           }),
           py::kw_only(), py::arg("lr"), py::arg("momentum"), py::arg("weight_decay"),
           py::arg("nesterov"), py::arg("adjust_lr"), py::arg("betas"), py::arg("eps"),
           py::arg("hyperball") = false, py::arg("hyperball_radius") = py::none(),
           py::arg("normuon_beta2") = 0.95, py::arg("normuon_eps") = 1e-8)
      .def("__eq__", [](const rfsdp::MuonOptions& a, const rfsdp::MuonOptions& b) {
             return std::tie(a.lr, a.momentum, a.weight_decay, a.nesterov, a.adjust_lr, a.adam_beta1,
                             a.adam_beta2, a.adam_eps, a.hyperball, a.hyperball_radius,
                             a.normuon_beta2, a.normuon_eps) ==
                    std::tie(b.lr, b.momentum, b.weight_decay, b.nesterov, b.adjust_lr, b.adam_beta1,
                             b.adam_beta2, b.adam_eps, b.hyperball, b.hyperball_radius,
                             b.normuon_beta2, b.normuon_eps);
           }, py::is_operator());
  py::class_<rfsdp::ShampooOptions>(m, "ShampooOptions")
      .def(py::init([](double lr, Betas betas, double epsilon, double grafting_beta2,
                       double grafting_epsilon, double weight_decay) {
             return rfsdp::ShampooOptions{lr, betas.first, betas.second, epsilon, grafting_beta2,
                                          grafting_epsilon, weight_decay};
           }),
           py::kw_only(), py::arg("lr"), py::arg("betas"), py::arg("epsilon"),
           py::arg("grafting_beta2"), py::arg("grafting_epsilon"), py::arg("weight_decay"))
      .def("__eq__", [](const rfsdp::ShampooOptions& a, const rfsdp::ShampooOptions& b) {
             return std::tie(a.lr, a.beta1, a.beta2, a.epsilon, a.grafting_beta2, a.grafting_epsilon,
                             a.weight_decay) ==
                    std::tie(b.lr, b.beta1, b.beta2, b.epsilon, b.grafting_beta2, b.grafting_epsilon,
                             b.weight_decay);
           }, py::is_operator());
  py::class_<rfsdp::SOAPOptions>(m, "SOAPOptions")
      .def(py::init([](double lr, Betas betas, double shampoo_beta, double eps, double weight_decay) {
             return rfsdp::SOAPOptions{lr, betas.first, betas.second, shampoo_beta, eps, weight_decay};
           }),
           py::kw_only(), py::arg("lr"), py::arg("betas"), py::arg("shampoo_beta"), py::arg("eps"),
           py::arg("weight_decay"))
      .def("__eq__", [](const rfsdp::SOAPOptions& a, const rfsdp::SOAPOptions& b) {
             return std::tie(a.lr, a.beta1, a.beta2, a.shampoo_beta, a.eps, a.weight_decay) ==
                    std::tie(b.lr, b.beta1, b.beta2, b.shampoo_beta, b.eps, b.weight_decay);
           }, py::is_operator());

  // The optimizers: the C++ classes over this rank's shards. Python's
  // rfsdp.optim keeps param groups, schedulers and state_dict; it sends the
  // gradients once per step (set_grads) and a group's options when they change.
  py::class_<rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::ShardedOptimizer>>(m, "ShardedOptimizer")
      .def("set_grads", [](rfsdp::ShardedOptimizer& o, const std::vector<std::optional<at::Tensor>>& gs) {
             std::vector<at::Tensor> grads;
             for (const auto& g : gs) grads.push_back(g ? *g : at::Tensor());
             o.set_grads(grads);
           })
      .def("set_groups", &rfsdp::ShardedOptimizer::set_groups)
      .def("set_param", &rfsdp::ShardedOptimizer::set_param)
      .def("set_rounding", [](rfsdp::ShardedOptimizer& o, const std::string& r, uint64_t seed) {
             o.set_rounding(rfsdp::parse_rounding(r), seed);
           })
      .def("step", &rfsdp::ShardedOptimizer::step, py::call_guard<py::gil_scoped_release>())  // collective
      .def("step_refused", &rfsdp::ShardedOptimizer::step_refused, py::arg("message"),
           py::arg("invalid_argument"), py::call_guard<py::gil_scoped_release>())  // collective
      .def("name", &rfsdp::ShardedOptimizer::name)
      .def("param_name", [](const rfsdp::ShardedOptimizer& o, size_t i) { return o.params().at(i).name; })
      .def("step_count", &rfsdp::ShardedOptimizer::step_count)
      .def("step_counts", &rfsdp::ShardedOptimizer::step_counts)
      .def("set_step_count", &rfsdp::ShardedOptimizer::set_step_count)
      .def("reset_state", &rfsdp::ShardedOptimizer::reset_state)
      .def("state_has_step", &rfsdp::ShardedOptimizer::state_has_step)
      .def("state", [](const rfsdp::ShardedOptimizer& o, size_t i) { return named(o.state(i)); })
      // {name: ("rows", 0, 0, 0, ()) or ("sequence", total, offset, shared, runs)}
      // (runs: ((offset, numel), ...) where the piece is not one run from offset)
      .def("state_layout", [](const rfsdp::ShardedOptimizer& o, size_t i) {
             py::dict d;
             for (const auto& l : o.state_layout(i)) {
               const bool rows = l.kind == rfsdp::StateLayout::Kind::kRows;
               py::list runs;
               for (const auto& [at, n] : l.runs) runs.append(py::make_tuple(at, n));
               d[py::str(l.name)] = py::make_tuple(rows ? "rows" : "sequence", l.total, l.offset,
                                                   l.shared, py::tuple(runs));
             }
             return d;
           })
      .def("state_bytes", &rfsdp::ShardedOptimizer::state_bytes)
      .def("fused_launches", &rfsdp::ShardedOptimizer::fused_launches)
      // The last step's metrics: {"step", "bytes_sent", "bytes_sent_total", "seconds",
      // "seconds_max", "update_tracked", "groups": [{"matrices", "tiles", "roots",
      // "update_sq", "update_numel"}]} (across_ranks: collective)
      .def("metrics", [](const rfsdp::ShardedOptimizer& o, bool across_ranks) {
             rfsdp::ShardedOptimizer::StepMetrics m;
             {
               py::gil_scoped_release release;
               m = o.metrics(across_ranks);
             }
             py::list groups;
             for (const auto& g : m.groups) {
               py::dict d;
               d["matrices"] = g.matrices, d["tiles"] = g.tiles, d["roots"] = g.roots;
               d["update_sq"] = g.update_sq, d["update_numel"] = g.update_numel;
               groups.append(d);
             }
             py::dict d;
             d["step"] = m.step, d["bytes_sent"] = m.bytes_sent;
             d["bytes_sent_total"] = m.bytes_sent_total, d["seconds"] = m.seconds;
             d["seconds_max"] = m.seconds_max, d["update_tracked"] = m.update_tracked;
             d["groups"] = groups;
             return d;
           }, py::arg("across_ranks"))
      .def("set_track_update", &rfsdp::ShardedOptimizer::set_track_update)
      .def("tracks_update", &rfsdp::ShardedOptimizer::tracks_update);

  py::class_<rfsdp::AdamW, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::AdamW>>(m, "AdamW")
      .def(py::init([](const std::vector<ShardOf>& params, std::shared_ptr<rfsdp::Comm> comm,
                       bool check_finite, bool fused_on_cpu) {
             rfsdp::AdamWOptions o;
             o.check_finite = check_finite;
             o.fused_on_cpu = fused_on_cpu;
             auto shards = shards_of(params);
             py::gil_scoped_release release;  // (collective where rows are unknown or hyperball)
             return std::make_shared<rfsdp::AdamW>(std::move(shards), o, std::move(comm));
           }),
           py::arg("params"), py::arg("comm"), py::arg("check_finite") = true,
           py::arg("fused_on_cpu") = false)
      .def("set_group_options", [](rfsdp::AdamW& o, size_t g, rfsdp::AdamWOptions x) {
             const rfsdp::AdamWOptions& now = o.group_options(g);  // (the optimizer's own flags)
             x.check_finite = now.check_finite;
             x.fused_on_cpu = now.fused_on_cpu;
             o.set_group_options(g, x);
           })
      .def("hyperball_bytes", &rfsdp::AdamW::hyperball_bytes);
  // The typed configs: the settings that shape an optimizer's state, built from
  // Python's arguments (checked here, by the library), settings() as a
  // checkpoint keeps them (a saved one builds the config again), requantizable:
  // the settings requantized_state moves between.
  py::class_<rfsdp::AdamW8bitConfig>(m, "AdamW8bitConfig")
      // None: the C++ default (AdamW8bitConfig's, the one place it is written).
      .def(py::init([](const py::object& block, const py::object& min_8bit_size,
                       const py::object& state_format) {
             rfsdp::AdamW8bitConfig c;
             if (!state_format.is_none()) c.state_format = state_format_arg(state_format, "AdamW8bit");
             if (!block.is_none()) {
               c.block = block_shape(py::isinstance<py::list>(block) ? py::tuple(block) : block);
             }
             c.block.check();
             if (!min_8bit_size.is_none()) {
               c.min_8bit_size = int_arg(min_8bit_size, "AdamW8bit", "min_8bit_size");
             }
             return c;
           }),
           py::kw_only(), py::arg("block") = py::none(), py::arg("min_8bit_size") = py::none(),
           py::arg("state_format") = py::none())
      .def("settings", [](const rfsdp::AdamW8bitConfig& c) {
             py::dict d;
             if (c.block.is_tile()) {
               d["block"] = py::list(py::make_tuple(c.block.tile_rows, c.block.tile_cols));
             } else {
               d["block"] = c.block.block;
             }
             d["min_8bit_size"] = c.min_8bit_size;
             put_state_format(d, c.state_format);
             return d;
           })
      .def_property_readonly_static("requantizable", [](const py::object&) {
             return rfsdp::AdamW8bitConfig::requantizable();
           });
  py::class_<rfsdp::AdamW8bit, rfsdp::AdamW, std::shared_ptr<rfsdp::AdamW8bit>>(m, "AdamW8bit")
      .def(py::init([](const std::vector<ShardOf>& params, const rfsdp::AdamW8bitConfig& config,
                       std::shared_ptr<rfsdp::Comm> comm, bool check_finite) {
             rfsdp::AdamWOptions o;
             o.check_finite = check_finite;
             auto shards = shards_of(params);
             // Collective (every rank's rows where unknown): a Gloo thread that frees an
             // earlier collective's Python tensors needs the GIL while this waits.
             py::gil_scoped_release release;
             return std::make_shared<rfsdp::AdamW8bit>(std::move(shards), o, config, std::move(comm));
           }),
           py::arg("params"), py::arg("config"), py::arg("comm"), py::arg("check_finite") = true)
      .def("requantized_state", &rfsdp::AdamW8bit::requantized_state, py::arg("i"),
           py::arg("saved"), py::arg("full"))
      // (global blocks, global index of the first absmax entry, leading entries of blocks
      // that start on an earlier rank)
      .def("block_span", [](const rfsdp::AdamW8bit& o, size_t i) {
             const auto s = o.block_span(i);
             return py::make_tuple(s.global_blocks, s.first, s.shared_head);
           })
      .def("shared_blocks", &rfsdp::AdamW8bit::shared_blocks);

  py::class_<rfsdp::MuonConfig>(m, "MuonConfig")
      .def(py::init([](const py::object& ns_dtype, const py::object& momentum_dtype,
                       const py::object& momentum_block, const std::string& momentum_map,
                       const py::object& ns_coefficients, bool normuon) {
             rfsdp::MuonConfig o;
             o.normuon = normuon;
             o.ns_coefficients = ns_coefficients_arg(ns_coefficients);
             o.ns_dtype = dtype_arg(ns_dtype, "Muon", "ns_dtype", "torch.float32 or torch.bfloat16");
             o.momentum_dtype = dtype_arg(momentum_dtype, "Muon", "momentum_dtype",
                                          "torch.float32, torch.bfloat16 or \"int8\" (8-bit "
                                          "block-wise codes)");
             o.momentum_block = int_arg(momentum_block, "Muon", "momentum_block");
             o.momentum_map = momentum_map;
             rfsdp::check_config(o);
             return o;
           }),
           py::kw_only(), py::arg("ns_dtype") = py::none(), py::arg("momentum_dtype") = py::none(),
           py::arg("momentum_block") = 256, py::arg("momentum_map") = "dynamic",
           py::arg("ns_coefficients") = py::none(), py::arg("normuon") = false)
      .def("settings", [](const rfsdp::MuonConfig& o) {
             py::dict d(py::arg("ns_dtype") = dtype_name(o.ns_dtype),
                        py::arg("momentum_dtype") = dtype_name(o.momentum_dtype),
                        py::arg("momentum_block") = o.momentum_block,
                        py::arg("momentum_map") = o.momentum_map);
             put_ns_coefficients(d, o.ns_coefficients);
             if (o.normuon) d["normuon"] = true;  // (absent: Muon, as checkpoints before NorMuon)
             return d;
           })
      .def_property_readonly_static("requantizable", [](const py::object&) {
             return rfsdp::MuonConfig::requantizable();
           });
  // Muon over one process group: roots chosen at construction (collective), then steps.
  py::class_<rfsdp::Muon, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::Muon>>(m, "Muon")
      .def(py::init([](const std::vector<ShardOf>& params, const std::vector<int>& ns_steps,
                       const rfsdp::MuonConfig& config, std::shared_ptr<rfsdp::Comm> comm,
                       const std::vector<bool>& use_muon,
                       const std::vector<std::vector<int64_t>>& split_sizes, bool check_finite,
                       const std::vector<int>& split_dims) {
             rfsdp::MuonConfig c = config;
             c.check_finite = check_finite;
             auto shards = shards_of(params);
             py::gil_scoped_release release;  // collective
             return std::make_shared<rfsdp::Muon>(std::move(shards), rfsdp::MuonOptions{}, c,
                                                  std::move(comm), ns_steps, use_muon, split_sizes,
                                                  split_dims);
           }),
           py::arg("params"), py::arg("ns_steps"), py::arg("config"), py::arg("comm"),
           py::arg("use_muon") = std::vector<bool>{},
           py::arg("split_sizes") = std::vector<std::vector<int64_t>>{}, py::arg("check_finite") = true,
           py::arg("split_dims") = std::vector<int>{})
      .def("requantized_state", &rfsdp::Muon::requantized_state, py::arg("i"), py::arg("saved"),
           py::arg("full"))
      .def("set_group_options", &rfsdp::Muon::set_group_options)
      .def("matrices", [](const rfsdp::Muon& o) {
             py::list out;
             for (const auto& x : o.layout().matrices()) {
               out.append(py::dict(py::arg("param") = o.muon_params().at(x.param), py::arg("offset") = x.offset,
                                   py::arg("rows") = x.rows, py::arg("cols") = x.cols,
                                   py::arg("root") = x.root, py::arg("flops") = x.flops,
                                   py::arg("col_blocks") = x.col_blocks));
             }
             return out;
           })
      .def("flop_imbalance", [](const rfsdp::Muon& o) { return o.layout().flop_imbalance(); })
      .def("gather_send_elems", [](const rfsdp::Muon& o) { return o.layout().gather_send_elems(); })
      .def("normalise_bytes", &rfsdp::Muon::normalise_bytes)
      // (tests only: fault injection, see Muon::skip_newton_schulz_for_test)
      .def("_skip_newton_schulz_for_test", &rfsdp::Muon::skip_newton_schulz_for_test);

  const rfsdp::ShampooConfig shampoo;  // (the defaults)
  py::class_<rfsdp::ShampooConfig>(m, "ShampooConfig")
      .def(py::init([](const py::object& max_dim, const py::object& frequency, const py::object& start,
                       bool bias_correction, const py::object& factor_dtype,
                       const std::string& rank_deficient, const py::object& rank_rtol,
                       const py::object& basis_dtype, const py::object& basis_block,
                       const std::string& basis_map, const py::object& bjorck_iterations) {
             const char* who = "Shampoo";
             rfsdp::ShampooConfig c;
             set_tiled(c, who, max_dim, frequency, factor_dtype);
             c.start_preconditioning_step = int_arg(start, who, "start_preconditioning_step");
             c.use_bias_correction = bias_correction;
             c.rank_deficient = rfsdp::parse_rank_deficient(rank_deficient);
             // (-1: None, as settings() keeps it)
             c.rank_rtol = rank_rtol.is_none() ? -1.0 : rank_rtol.cast<double>();
             if (!rank_rtol.is_none() && !(c.rank_rtol >= 0) && c.rank_rtol != -1.0) {
               throw std::invalid_argument("Shampoo: rank_rtol must be in [0, 1) (None: n * "
                                           "eps(float32) for an n x n factor), got " +
                                           py::repr(rank_rtol).cast<std::string>());
             }
             int bits = 0;  // (None: packed roots; a dtype is no code name: refused)
             const char* basis_allowed = "None (roots in factor_dtype), \"int8\" or \"int4\"";
             dtype_arg(basis_dtype, who, "basis_dtype", basis_allowed, at::kByte, &bits);
             if (!basis_dtype.is_none() && bits == 0) {
               throw std::invalid_argument(std::string(who) + ": basis_dtype must be " + basis_allowed +
                                           ", got " + py::repr(basis_dtype).cast<std::string>());
             }
             c.basis = basis_format(who, bits, basis_block, basis_map, bjorck_iterations);
             rfsdp::check_config(c);
             return c;
           }),
           py::kw_only(), py::arg("max_preconditioner_dim") = shampoo.max_preconditioner_dim,
           py::arg("precondition_frequency") = shampoo.precondition_frequency,
           py::arg("start_preconditioning_step") = shampoo.start_preconditioning_step,
           py::arg("use_bias_correction") = shampoo.use_bias_correction, py::arg("factor_dtype") = py::none(),
           py::arg("rank_deficient") = rfsdp::to_string(shampoo.rank_deficient),
           py::arg("rank_rtol") = py::none(), py::arg("basis_dtype") = py::none(),
           py::arg("basis_block") = shampoo.basis.block, py::arg("basis_map") = shampoo.basis.map,
           py::arg("bjorck_iterations") = shampoo.basis.bjorck_iterations)
      .def("settings", [](const rfsdp::ShampooConfig& c) {
             py::dict d = tiled_settings(c);
             d["start_preconditioning_step"] = c.start_preconditioning_step;
             d["use_bias_correction"] = c.use_bias_correction;
             d["rank_deficient"] = rfsdp::to_string(c.rank_deficient);
             d["rank_rtol"] = c.rank_rtol;
             if (c.basis.coded()) {  // (packed roots: the settings they had before basis_dtype)
               d["basis_dtype"] = c.basis.bits == 8 ? "int8" : "int4";
               put_basis(d, c.basis);
             }
             return d;
           })
      .def_property_readonly_static("requantizable", [](const py::object&) {
             return rfsdp::ShampooConfig::requantizable();
           });
  // Shampoo: each rank's tiles are its own (no communication but the NaN flag).
  bind_tiled<rfsdp::Shampoo, rfsdp::ShampooOptions, rfsdp::ShampooConfig>(m, "Shampoo")
      .def("factor_bytes", &rfsdp::Shampoo::factor_bytes)
      .def("root_seconds", &rfsdp::Shampoo::root_seconds);
  const rfsdp::SOAPConfig soap;  // (the defaults)
  py::class_<rfsdp::SOAPConfig>(m, "SOAPConfig")
      .def(py::init([](const py::object& max_dim, const py::object& frequency, bool correct_bias,
                       const py::object& factor_dtype, const py::object& basis_dtype,
                       const py::object& state_dtype, const py::object& basis_block,
                       const std::string& basis_map, const py::object& bjorck_iterations,
                       const py::object& state_format) {
             const char* who = "SOAP";
             rfsdp::SOAPConfig c;
             set_tiled(c, who, max_dim, frequency, factor_dtype);
             c.correct_bias = correct_bias;
             int bits = 0;
             c.basis_dtype = dtype_arg(basis_dtype, who, "basis_dtype",
                                       "torch.float32, torch.bfloat16, \"int8\" or \"int4\"",
                                       at::kFloat, &bits);
             if (bits) c.basis_dtype = at::kFloat;  // (unused when coded)
             c.state_dtype = dtype_arg(state_dtype, who, "state_dtype",
                                       "torch.float32 or \"int8\" (8-bit codes)");
             c.basis = basis_format(who, bits, basis_block, basis_map, bjorck_iterations);
             if (!state_format.is_none()) c.state_format = state_format_arg(state_format, who);
             rfsdp::check_config(c);
             return c;
           }),
           py::kw_only(), py::arg("max_preconditioner_dim") = soap.max_preconditioner_dim,
           py::arg("precondition_frequency") = soap.precondition_frequency,
           py::arg("correct_bias") = soap.correct_bias, py::arg("factor_dtype") = py::none(),
           py::arg("basis_dtype") = py::none(), py::arg("state_dtype") = py::none(),
           py::arg("basis_block") = soap.basis.block, py::arg("basis_map") = soap.basis.map,
           py::arg("bjorck_iterations") = soap.basis.bjorck_iterations,
           py::arg("state_format") = py::none())
      .def("settings", [](const rfsdp::SOAPConfig& c) {
             py::dict d = tiled_settings(c);
             d["correct_bias"] = c.correct_bias;
             d["basis_dtype"] = c.basis.coded() ? (c.basis.bits == 8 ? "int8" : "int4")
                                                : dtype_name(c.basis_dtype);
             d["state_dtype"] = dtype_name(c.state_dtype);
             put_state_format(d, c.state_format);
             put_basis(d, c.basis);
             return d;
           })
      .def_property_readonly_static("requantizable", [](const py::object&) {
             return rfsdp::SOAPConfig::requantizable();
           });
  bind_tiled<rfsdp::SOAP, rfsdp::SOAPOptions, rfsdp::SOAPConfig>(m, "SOAP");
  m.def("shampoo_granule_rows", &rfsdp::tile_granule_rows, py::arg("shape"),
        py::arg("row_dims"), py::arg("max_preconditioner_dim"));

  m.def("newton_schulz",
        [](const at::Tensor& g, int steps, const std::string& dtype, const py::object& coefficients) {
          const rfsdp::NsCoefficients ns = ns_coefficients_arg(coefficients);
          py::gil_scoped_release release;
          return rfsdp::newton_schulz(g, steps, dtype_of(dtype), ns);
        },
        py::arg("g"), py::arg("steps") = 5, py::arg("dtype") = "float32",
        py::arg("coefficients") = py::none(),
        "Muon's Newton–Schulz of a matrix or a batch of matrices (float32 result)");
}

}  // namespace rfsdp_bind
