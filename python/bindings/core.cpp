// rfsdp._C: core/ (the layout model, the planner, Comm and agreement).
#include "python/bindings/bindings.h"

#include "core/comm/agree.h"
#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"
#include "core/ragged/step_model.h"
#include "core/ragged/tensor_shard.h"
#include "core/ragged/tensor_spec.h"

namespace rfsdp_bind {

namespace {

rfsdp::PlannerOptions planner_options(const py::object& max_buffers,
                                      const py::object& collective_cost_bytes) {
  rfsdp::PlannerOptions o;
  o.max_buffers = int_arg(max_buffers, "PlannerOptions", "max_buffers", kFits64);
  o.collective_cost_bytes = int_arg(collective_cost_bytes, "PlannerOptions",
                                    "collective_cost_bytes", kFits64);
  try {
    rfsdp::check_planner_options(o);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("PlannerOptions: ") + e.what());
  }
  return o;
}

// Plans from Python's spec list: [(name, shape, granule_rows (0 = whole), row_dims, dtype_bytes,
// blocks, blocks_dim)].
rfsdp::Plan plan_specs(const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int,
                                                    int64_t, std::vector<int64_t>, int>>& specs,
                       int64_t world_size, int64_t align_bytes,
                       const rfsdp::PlannerOptions& options) {
  std::vector<rfsdp::TensorSpec> ts;
  for (const auto& [name, shape, g, row_dims, bytes, blocks, blocks_dim] : specs) {
    rfsdp::TensorSpec t;
    t.name = name;
    t.shape = shape;
    t.granule_rows = g == 0 ? rfsdp::kWholeTensor : g;
    t.row_dims = row_dims;
    t.elem_bytes = bytes;
    t.blocks = blocks;
    t.blocks_dim = blocks_dim;
    ts.push_back(t);
  }
  return rfsdp::plan_unit(ts, world_size, align_bytes, options);
}

// A Comm over a torch.distributed group, with a timeout in seconds as Python
// gives it. Destroying it may destroy the group, whose Gloo worker threads can
// need the GIL to free Python-owned tensors while it joins them: the GIL is
// released for that.
std::shared_ptr<rfsdp::Comm> make_comm(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       double timeout_seconds) {
  return std::shared_ptr<rfsdp::Comm>(
      new rfsdp::Comm(pg, std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000))),
      [](rfsdp::Comm* c) {
        if (PyGILState_Check()) {
          py::gil_scoped_release release;
          delete c;
        } else {
          delete c;
        }
      });
}

}  // namespace

void bind_core(py::module_& m) {
  py::class_<rfsdp::CommHandle>(m, "CommHandle")
      .def("wait", &rfsdp::CommHandle::wait, py::call_guard<py::gil_scoped_release>())
      .def("waited", &rfsdp::CommHandle::waited);

  py::class_<rfsdp::Comm, std::shared_ptr<rfsdp::Comm>>(m, "Comm")
      .def(py::init(&make_comm), py::arg("process_group"), py::arg("timeout_seconds") = 300.0)
      .def("rank", &rfsdp::Comm::rank)
      .def("size", &rfsdp::Comm::size)
      .def("close", &rfsdp::Comm::close, py::call_guard<py::gil_scoped_release>())
      .def("closed", &rfsdp::Comm::closed)
      .def("stats", [](const rfsdp::Comm& c) { return stats_dict(c.stats()); })
      .def("reset_stats", &rfsdp::Comm::reset_stats);

  // One rank's piece of a tensor (core/ragged/tensor_shard.h): what fully_shard
  // makes per parameter and every optimizer, clipping and checkpoint reads;
  // rfsdp.ShardInfo is a view of it.
  py::class_<rfsdp::TensorShard>(m, "TensorShard")
      .def(py::init(&rfsdp::TensorShard::rows_of), py::arg("name"), py::arg("shape"),
           py::arg("row_dims"), py::arg("row_begin"), py::arg("row_end"),
           py::arg("rank_rows") = std::vector<std::pair<int64_t, int64_t>>())
      .def_static("column_parts", &rfsdp::TensorShard::column_parts, py::arg("name"),
                  py::arg("shape"), py::arg("parts"), py::arg("row_begin"), py::arg("row_end"),
                  py::arg("rank_rows") = std::vector<std::pair<int64_t, int64_t>>())
      .def_static("whole", &rfsdp::TensorShard::whole, py::arg("name"), py::arg("shape"),
                  py::arg("row_dims") = 1)
      .def_readonly("name", &rfsdp::TensorShard::name)
      .def_property_readonly("shape", [](const rfsdp::TensorShard& t) {
             return py::tuple(py::cast(t.shape));
           })
      .def_readonly("row_dims", &rfsdp::TensorShard::row_dims)
      .def_readonly("full_rows", &rfsdp::TensorShard::full_rows)
      .def_readonly("row_len", &rfsdp::TensorShard::row_len)
      .def_readonly("row_begin", &rfsdp::TensorShard::row_begin)
      .def_readonly("row_end", &rfsdp::TensorShard::row_end)
      .def_readonly("rank_rows", &rfsdp::TensorShard::rank_rows)
      .def_readonly("blocks", &rfsdp::TensorShard::blocks)
      .def_readonly("blocks_dim", &rfsdp::TensorShard::blocks_dim)
      .def_readonly("col_parts", &rfsdp::TensorShard::col_parts)
      .def("renamed", &rfsdp::TensorShard::renamed, py::arg("name"))
      // (a tensor-parallel piece's shard of the global tensor: the plan's blocks of it)
      .def("with_blocks", [](rfsdp::TensorShard t, std::vector<int64_t> blocks, int dim) {
             t.blocks = std::move(blocks);
             t.blocks_dim = dim;
             return t;
           }, py::arg("blocks"), py::arg("blocks_dim"))
      .def(py::pickle(
          [](const rfsdp::TensorShard& t) {
            return py::make_tuple(t.name, t.shape, t.row_dims, t.row_begin, t.row_end, t.rank_rows,
                                  t.blocks, t.blocks_dim, t.col_parts);
          },
          [](const py::tuple& s) {
            rfsdp::TensorShard t = rfsdp::TensorShard::rows_of(
                s[0].cast<std::string>(), s[1].cast<std::vector<int64_t>>(), s[2].cast<int>(),
                s[3].cast<int64_t>(), s[4].cast<int64_t>(),
                s[5].cast<std::vector<std::pair<int64_t, int64_t>>>());
            if (s.size() > 6) t.blocks = s[6].cast<std::vector<int64_t>>();
            if (s.size() > 7) t.blocks_dim = s[7].cast<int>();
            if (s.size() > 8 && s[8].cast<int>() > 1) {  // (rows_of checked the virtual rows' shape)
              t = rfsdp::TensorShard::column_parts(t.name, t.shape, s[8].cast<int>(), t.row_begin,
                                                   t.row_end, t.rank_rows);
            }
            return t;
          }));
  m.def("block_granule_rows", [](const std::string& name, const std::vector<int64_t>& shape,
                                 int row_dims, const std::vector<int64_t>& blocks,
                                 int blocks_dim) -> py::object {
          const int64_t g = rfsdp::block_granule_rows(name, shape, row_dims, blocks, blocks_dim);
          return g == rfsdp::kWholeTensor ? py::object(py::str("whole")) : py::object(py::int_(g));
        },
        py::arg("name"), py::arg("shape"), py::arg("row_dims"), py::arg("blocks"),
        py::arg("blocks_dim") = 0,
        "The granule (rows) that keeps every logical block of a tensor whole, or \"whole\"");

  // Every rank's lines equal, or a ValueError on every rank naming the first
  // difference (collective; fully_shard's agreement).
  m.def("agree_lines", [](std::shared_ptr<rfsdp::Comm> comm, const std::vector<std::string>& lines,
                          const std::string& what) {
          py::gil_scoped_release release;  // collective
          rfsdp::agree_lines(*comm, lines, what);
        }, py::arg("comm"), py::arg("lines"), py::arg("what"));

  // (rows, row length) of a tensor seen as rows of its first row_dims dims: the
  // one definition (TensorSpec) that fully_shard, the policies and the optimizers use.
  m.def("row_geometry", [](const std::vector<int64_t>& shape, int row_dims) {
          const int max_row_dims = shape.empty() ? 1 : static_cast<int>(shape.size());
          if (row_dims < 1 || row_dims > max_row_dims) {
            throw std::invalid_argument("row_dims " + std::to_string(row_dims) +
                                        " is out of range [1, " + std::to_string(max_row_dims) +
                                        "] for shape " + rfsdp::shape_to_string(shape));
          }
          rfsdp::TensorSpec t;
          t.shape = shape;
          t.row_dims = row_dims;
          return py::make_tuple(t.rows(), t.row_elems());
        }, py::arg("shape"), py::arg("row_dims") = 1);

  const rfsdp::PlannerOptions defaults;
  py::class_<rfsdp::PlannerOptions>(m, "PlannerOptions", R"(How a unit may be laid out: in up to
max_buffers flat buffers, each with its own collective, chosen by the bytes a rank receives
in a gather (m x S x dtype bytes) plus collective_cost_bytes (latency x bandwidth) per
buffer; one buffer whenever it is as good. max_buffers=1: always one buffer. The defaults
and limits are the planner's (core/ragged/planner.h): a ValueError names a value outside them.)")
      .def(py::init(&planner_options), py::kw_only(),
           py::arg("max_buffers") = defaults.max_buffers,
           py::arg("collective_cost_bytes") = defaults.collective_cost_bytes)
      .def_readonly("max_buffers", &rfsdp::PlannerOptions::max_buffers)
      .def_readonly("collective_cost_bytes", &rfsdp::PlannerOptions::collective_cost_bytes)
      .def("__eq__", [](const rfsdp::PlannerOptions& a, const py::object& b) {
        if (!py::isinstance<rfsdp::PlannerOptions>(b)) return false;
        const auto& o = b.cast<const rfsdp::PlannerOptions&>();
        return a.max_buffers == o.max_buffers && a.collective_cost_bytes == o.collective_cost_bytes;
      })
      .def("__hash__", [](const rfsdp::PlannerOptions& o) {
        return py::hash(py::make_tuple(o.max_buffers, o.collective_cost_bytes));
      })
      .def("__repr__", [](const rfsdp::PlannerOptions& o) {
        return "PlannerOptions(max_buffers=" + std::to_string(o.max_buffers) +
               ", collective_cost_bytes=" + std::to_string(o.collective_cost_bytes) + ")";
      })
      .def(py::pickle(
          [](const rfsdp::PlannerOptions& o) {
            return py::make_tuple(o.max_buffers, o.collective_cost_bytes);
          },
          [](const py::tuple& t) { return planner_options(t[0], t[1]); }));

  m.def("plan_specs", &plan_specs, py::arg("specs"), py::arg("world_size"),
        py::arg("align_bytes") = rfsdp::kDefaultAlignBytes, py::arg("options") = defaults);

  // Errors from the library are std::invalid_argument -> ValueError (pybind11's default).
  py::class_<rfsdp::Plan>(m, "Plan")
      .def_readonly("world_size", &rfsdp::Plan::world_size)
      .def_readonly("S", &rfsdp::Plan::shard_elems)
      .def_readonly("align_bytes", &rfsdp::Plan::align_bytes)
      .def_readonly("offsets", &rfsdp::Plan::offsets)  // in each tensor's buffer
      .def_property_readonly("buffers",  // S_b of each buffer (one collective each)
                             [](const rfsdp::Plan& p) {
                               std::vector<int64_t> s;
                               for (size_t b = 0; b < p.num_buffers(); ++b) s.push_back(p.buffer_shard(b));
                               return s;
                             })
      .def_property_readonly("buffer_of",
                             [](const rfsdp::Plan& p) {
                               std::vector<size_t> b;
                               for (size_t i = 0; i < p.tensors.size(); ++i) b.push_back(p.buffer_index(i));
                               return b;
                             })
      .def("global_offset", &rfsdp::Plan::global_offset)  // tensor i's first element, gathered
      .def("block_slots", [](const rfsdp::Plan& p, int64_t block) { return rfsdp::block_slots(p, block); })
      // Bytes a rank sends in one gather / one gradient reduction (core/ragged/step_model.h):
      // weights of weight_bytes (code_block > 0: 1-byte codes + an fp32 scale a block),
      // gradients of grad_bytes; replicas > 1 (HSDP) add the slice to each other replica.
      .def("gather_bytes", [](const rfsdp::Plan& p, int64_t weight_bytes, int64_t code_block) {
             return rfsdp::gather_bytes(p, {weight_bytes, code_block, 4, 4});
           }, py::arg("weight_bytes") = 2, py::arg("code_block") = 0)
      .def("reduce_bytes", [](const rfsdp::Plan& p, int64_t grad_bytes, int64_t replicas,
                              int64_t replica_bytes) {
             return rfsdp::reduce_bytes(p, {2, 0, grad_bytes, replica_bytes}, replicas);
           }, py::arg("grad_bytes") = 4, py::arg("replicas") = 1, py::arg("replica_bytes") = 4)
      .def("block_cut", [](const rfsdp::Plan& p, int64_t block) -> py::object {
        const auto cut = rfsdp::first_block_cut(p, block);  // (tensor name, rank, element) or None
        if (!cut) return py::none();
        return py::make_tuple(p.tensors[cut->tensor].name, cut->rank, cut->element);
      })
      .def_readonly("plan_seconds", &rfsdp::Plan::plan_seconds)
      .def_property_readonly("padding_fraction", &rfsdp::Plan::padding_fraction)
      .def_property_readonly("lower_bound_S", &rfsdp::Plan::lower_bound_shard_elems)
      .def_property_readonly("names",
                             [](const rfsdp::Plan& p) {
                               std::vector<std::string> n;
                               for (const auto& t : p.tensors) n.push_back(t.name);
                               return n;
                             })
      .def("shard",
           [](const rfsdp::Plan& p, size_t i, int64_t rank) {
             const auto r = p.shard(i, rank);
             return py::make_tuple(r.row_begin, r.row_end, r.local_offset, r.numel);
           },
           "(row_begin, row_end, local_offset, numel) of tensor i on a rank")
      .def("to_json", [](const rfsdp::Plan& p) { return rfsdp::plan_to_json(p); });

  // rfsdp.plan: world_size and align_bytes as any Python integer (numpy's too).
  m.def("plan_json",
        [](const std::string& unit_json, const py::object& world_size, const py::object& align_bytes,
           const rfsdp::PlannerOptions& options) {
          return rfsdp::plan_unit(rfsdp::unit_from_json(unit_json),
                                  int_arg(world_size, "rfsdp.plan", "world_size", kFits64),
                                  int_arg(align_bytes, "rfsdp.plan", "align_bytes", kFits64), options);
        },
        py::arg("unit_json"), py::arg("world_size"),
        py::arg("align_bytes") = rfsdp::kDefaultAlignBytes, py::arg("options") = defaults);
}

}  // namespace rfsdp_bind
