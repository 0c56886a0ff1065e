// The autograd node of a prepared add_dropout_norm call (norm.py), in C++: its backward runs on autograd's
// worker thread without taking the GIL, and both passes launch the Triton kernels that norm.py compiled
// straight through the driver's cuLaunchKernel.
//
// Python builds a NormPlan once per prepared call (ops/native.py): every kernel parameter is either a tensor
// slot (a pointer filled in per call) or a constant of the call signature (sizes, strides, eps, ...). The
// forward always runs here; the backward runs here for the gradient layouts it was given (set_backward),
// and hands any other to the Python fallback (the op's general backward), under the GIL.
#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdint>
#include <vector>

#if __has_include(<cuda_runtime_api.h>) && __has_include(<c10/cuda/CUDAStream.h>)
#include <c10/cuda/CUDAStream.h>
#define TILEWISE_HAVE_CUDA_STREAM 1
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// cuLaunchKernel's signature (CUresult is an int, CUfunction and CUstream pointers): its address comes from
// Python, so no CUDA header or library is needed to build this file.
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);

void* current_stream(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
#ifdef TILEWISE_HAVE_CUDA_STREAM
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device()).native_handle();
#endif
}

struct Param {
  int slot;         // >= 0: the data pointer of that tensor slot; -1: the constant below
  uint64_t bits;    // the constant's bytes, little-endian (the kernel reads as many as its type has)
};

// One kernel launch: Triton's parameters (constexprs excluded), then its two scratch pointers (null: the
// plan is only built for kernels that need none).
struct Launch {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 0;
  unsigned shared = 0;
  std::vector<Param> params;

  void run(LaunchFn launch, void* stream, const at::Tensor* const* slots) const {
    const size_t n = params.size();
    uint64_t values[64];
    void* pointers[64];
    TORCH_CHECK(n + 2 <= 64, "tilewise native norm: ", n, " kernel parameters is over 62");
    for (size_t i = 0; i < n; ++i) {
      const Param& p = params[i];
      if (p.slot >= 0) {
        TORCH_CHECK(slots[p.slot]->defined(), "tilewise native norm: kernel parameter ", i, " reads tensor slot ",
                    p.slot, ", which this call left empty");
        values[i] = reinterpret_cast<uint64_t>(slots[p.slot]->data_ptr());
      } else {
        values[i] = p.bits;
      }
      pointers[i] = &values[i];
    }
    values[n] = values[n + 1] = 0;
    pointers[n] = &values[n];
    pointers[n + 1] = &values[n + 1];
    const int err = launch(reinterpret_cast<void*>(function), grid[0], grid[1], grid[2], threads, 1, 1, shared,
                           stream, pointers, nullptr);
    TORCH_CHECK(err == 0, "tilewise native norm: cuLaunchKernel returned CUDA error ", err);
  }
};

Launch make_launch(uint64_t function, std::vector<unsigned> grid, unsigned threads, unsigned shared,
                   const std::vector<std::pair<int, uint64_t>>& params) {
  TORCH_CHECK(grid.size() == 3, "tilewise native norm: a grid has 3 dimensions, got ", grid.size());
  Launch l;
  l.function = function;
  for (int i = 0; i < 3; ++i) l.grid[i] = grid[i];
  l.threads = threads;
  l.shared = shared;
  for (const auto& p : params) l.params.push_back(Param{p.first, p.second});
  return l;
}

// The gradient layout a backward plan was built for: contiguous, dtype and the pointer's low four bits.
struct GradLayout {
  at::ScalarType dtype;
  int64_t align;
  bool matches(const at::Tensor& g, at::IntArrayRef shape) const {
    return g.scalar_type() == dtype && g.is_contiguous() && g.sizes() == shape &&
           (reinterpret_cast<uint64_t>(g.data_ptr()) & 15) == static_cast<uint64_t>(align);
  }
};

struct Backward {
  std::atomic<bool> ready{false};   // set last (release), read first (acquire): the fields are complete then
  GradLayout dy{}, dh{};
  Launch rows, sums;
  at::Tensor part;          // the partial sums' buffer, on part_stream
  void* part_stream = nullptr;
};

// Forward slots: x, residual, weight, bias, x_bias, y, h, stats.
// Backward slots: dy, dh, h, weight, stats, dx, dr, part, dw, db, dx_bias.
struct NormPlan {
  LaunchFn launch;
  py::object fallback;      // (dy, dh, h, weight, stats) -> (dx, dresidual, dweight, dbias, dx_bias)
  std::vector<int64_t> shape, stats_shape;
  at::TensorOptions y_options, h_options, stats_options;
  Launch forward;
  Backward backward[2];     // without dh, with dh
  bool has_residual = false, has_bias = false, has_x_bias = false;
  at::TensorOptions dx_options, dw_options, db_options, dxb_options, dr_options;
  bool separate_dr = false;
  int64_t width = 0;

  NormPlan(uint64_t launch_address, py::object fallback_fn, std::vector<int64_t> shape_,
           std::vector<int64_t> stats_shape_, const at::Tensor& y_like, const at::Tensor& h_like,
           const at::Tensor& stats_like, bool residual, bool bias, bool x_bias)
      : launch(reinterpret_cast<LaunchFn>(launch_address)), fallback(std::move(fallback_fn)), shape(std::move(shape_)),
        stats_shape(std::move(stats_shape_)), y_options(y_like.options()), h_options(h_like.options()),
        stats_options(stats_like.options()), has_residual(residual), has_bias(bias), has_x_bias(x_bias) {
    TORCH_CHECK(launch_address != 0, "tilewise native norm: no cuLaunchKernel address");
    width = shape.empty() ? 0 : shape.back();
  }

  void set_forward(uint64_t function, std::vector<unsigned> grid, unsigned threads, unsigned shared,
                   const std::vector<std::pair<int, uint64_t>>& params) {
    forward = make_launch(function, std::move(grid), threads, shared, params);
  }

  // The gradient tensors' templates: dx_like, dw_like always; dr_like undefined where dx serves for
  // dresidual; db_like / dxb_like undefined without a bias / x_bias.
  void set_grads(const at::Tensor& dx_like, const std::optional<at::Tensor>& dr_like, const at::Tensor& dw_like,
                 const std::optional<at::Tensor>& db_like, const std::optional<at::Tensor>& dxb_like) {
    dx_options = dx_like.options();
    dw_options = dw_like.options();
    separate_dr = dr_like.has_value();
    if (dr_like) dr_options = dr_like->options();
    if (db_like) db_options = db_like->options();
    if (dxb_like) dxb_options = dxb_like->options();
  }

  void set_backward(bool with_dh, py::object dy_dtype, int64_t dy_align, py::object dh_dtype, int64_t dh_align,
                    uint64_t rows_function, std::vector<unsigned> rows_grid, unsigned rows_threads,
                    unsigned rows_shared, const std::vector<std::pair<int, uint64_t>>& rows_params,
                    uint64_t sums_function, std::vector<unsigned> sums_grid, unsigned sums_threads,
                    unsigned sums_shared, const std::vector<std::pair<int, uint64_t>>& sums_params,
                    const at::Tensor& part, uint64_t part_stream) {
    Backward& b = backward[with_dh ? 1 : 0];
    b.dy = GradLayout{torch::python::detail::py_object_to_dtype(dy_dtype), dy_align};
    if (with_dh) b.dh = GradLayout{torch::python::detail::py_object_to_dtype(dh_dtype), dh_align};
    b.rows = make_launch(rows_function, std::move(rows_grid), rows_threads, rows_shared, rows_params);
    b.sums = make_launch(sums_function, std::move(sums_grid), sums_threads, sums_shared, sums_params);
    b.part = part;
    b.part_stream = reinterpret_cast<void*>(part_stream);
    b.ready.store(true, std::memory_order_release);
  }

  bool has_backward(bool with_dh) const { return backward[with_dh ? 1 : 0].ready.load(std::memory_order_acquire); }
};

struct NormNode : public torch::autograd::Function<NormNode> {
  // residual, bias, x_bias: std::optional, as Function::apply takes absent tensors
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& r,
                               const at::Tensor& weight, const std::optional<at::Tensor>& b,
                               const std::optional<at::Tensor>& xb, int64_t plan_address) {
    const NormPlan& plan = *reinterpret_cast<const NormPlan*>(plan_address);
    const at::Tensor residual = r.value_or(at::Tensor()), bias = b.value_or(at::Tensor());
    const at::Tensor x_bias = xb.value_or(at::Tensor());
    c10::DeviceGuard guard(x.device());
    at::Tensor y = at::empty(plan.shape, plan.y_options);
    at::Tensor h = at::empty(plan.shape, plan.h_options);
    at::Tensor stats = at::empty(plan.stats_shape, plan.stats_options);
    const at::Tensor* slots[] = {&x, &residual, &weight, &bias, &x_bias, &y, &h, &stats};
    plan.forward.run(plan.launch, current_stream(x), slots);
    ctx->save_for_backward({h, weight, stats});
    ctx->saved_data["plan"] = plan_address;
    ctx->set_materialize_grads(false);
    return {y, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NormPlan& plan = *reinterpret_cast<const NormPlan*>(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &weight = saved[1], &stats = saved[2];
    const at::Tensor &dy = grads[0], &dh = grads[1];
    const Backward& b = plan.backward[dh.defined() ? 1 : 0];
    void* stream = current_stream(h);
    if (!b.ready.load(std::memory_order_acquire) || !dy.defined() || !b.dy.matches(dy, plan.shape) || (dh.defined() && !b.dh.matches(dh, plan.shape)) ||
        stream != b.part_stream) {
      return python_backward(plan, dy, dh, h, weight, stats);
    }
    c10::DeviceGuard guard(h.device());
    at::Tensor dx = at::empty(plan.shape, plan.dx_options);
    at::Tensor dr = plan.separate_dr ? at::empty(plan.shape, plan.dr_options) : at::Tensor();
    at::Tensor dw, db, dxb;
    const at::Tensor* slots[] = {&dy, &dh, &h, &weight, &stats, &dx, &dr, &b.part, &dw, &db, &dxb};
    b.rows.run(plan.launch, stream, slots);     // the row kernel first: the sums' outputs are allocated under it
    dw = at::empty({plan.width}, plan.dw_options);
    if (plan.has_bias) db = at::empty({plan.width}, plan.db_options);
    if (plan.has_x_bias) dxb = at::empty({plan.width}, plan.dxb_options);
    b.sums.run(plan.launch, stream, slots);
    at::Tensor dres = plan.has_residual ? (plan.separate_dr ? dr : dx) : at::Tensor();
    return {dx, dres, dw, db, dxb, at::Tensor()};
  }

  static variable_list python_backward(const NormPlan& plan, const at::Tensor& dy, const at::Tensor& dh,
                                       const at::Tensor& h, const at::Tensor& weight, const at::Tensor& stats) {
    py::gil_scoped_acquire gil;
    py::object none = py::none();
    py::tuple out = plan.fallback(dy.defined() ? py::cast(dy) : none, dh.defined() ? py::cast(dh) : none, h, weight,
                                  stats);
    TORCH_CHECK(out.size() == 5, "tilewise native norm: the Python backward returned ", out.size(), " values, not 5");
    variable_list result;
    for (size_t i = 0; i < 5; ++i) result.push_back(out[i].is_none() ? at::Tensor() : out[i].cast<at::Tensor>());
    result.emplace_back();
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> apply(const NormPlan& plan, const at::Tensor& x,
                                         const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         const std::optional<at::Tensor>& x_bias) {
  variable_list out = NormNode::apply(x, residual, weight, bias, x_bias, reinterpret_cast<int64_t>(&plan));
  return {out[0], out[1]};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NormPlan>(m, "NormPlan")
      .def(py::init<uint64_t, py::object, std::vector<int64_t>, std::vector<int64_t>, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, bool, bool, bool>())
      .def("set_forward", &NormPlan::set_forward)
      .def("set_grads", &NormPlan::set_grads)
      .def("set_backward", &NormPlan::set_backward)
      .def("has_backward", &NormPlan::has_backward)
      .def("apply", &apply);
  // what a launch from a call on t's device would go to (for tests)
  m.def("current_stream", [](const at::Tensor& t) { return reinterpret_cast<uint64_t>(current_stream(t)); });
}
