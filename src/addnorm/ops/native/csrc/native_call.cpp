// addnorm's native call: the fused Add & Norm's eager call as a C++ autograd node whose forward and
// backward launch the kernels Triton compiled for the call's signature (their CUfunction, block,
// shared memory and parameter layout registered from Python: addnorm/ops/native/layout.py), with
// cuLaunchKernel reached through dlopen of the driver, on the current stream of the current device
// (libc10's device guard: the CPU wheel has no c10/cuda headers). A call whose kernel is not
// registered yet (a first call, another specialisation, an unaligned or strided tensor) launches
// through the Python launchers the NativePlan holds (today's launchers, which compile and are then
// registered), inside the same node. See addnorm/ops/native/__init__.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

namespace {

// a torch.dtype's scalar type (torch/python.h's py_object_to_dtype, without that header's nn API)
at::ScalarType dtype_of(const py::object& object) {
  TORCH_CHECK_TYPE(THPDtype_Check(object.ptr()), "Expected dtype");
  return reinterpret_cast<THPDtype*>(object.ptr())->scalar_type;
}

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);

LaunchFn launch_fn() {
  static LaunchFn fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "addnorm native call: cannot open libcuda.so.1: ", dlerror());
    void* sym = dlsym(lib, "cuLaunchKernel");
    TORCH_CHECK(sym != nullptr, "addnorm native call: libcuda.so.1 has no cuLaunchKernel");
    return reinterpret_cast<LaunchFn>(sym);
  }();
  return fn;
}

// A kernel parameter: where its bytes come from (kind), how many (size), the tensor slot or value.
enum Kind : int8_t { CONST = 0, TENSOR = 1, ROWS = 2, PER_PROGRAM = 3, SEED = 4 };
struct Param {
  int8_t kind;
  int8_t size;
  int16_t slot;
  uint64_t value;  // CONST: the bytes, little-endian
};
constexpr int MAX_PARAMS = 48;
constexpr int KEY = 12;
using Key = std::array<int64_t, KEY>;

struct Kernel {
  Key key;
  void* function;
  unsigned block_x, smem;
  std::vector<Param> params;
};

inline int64_t code(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1; }
inline int64_t int_kind(int64_t v) {  // as addnorm.ops.triton.direct_launch.int_kind
  return (v == 1) | ((v % 16 == 0) << 1) | (((v >> 31) != 0) << 2);
}
inline bool aligned(const Tensor& t) { return !t.defined() || (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// the current device and stream (libc10's guard for CUDA; a test may register a fake one on the CPU)
struct Where {
  int64_t device;
  void* stream;
};
Where current() {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Device dev = impl->getDevice();
  return {dev.index(), impl->getStreamNativeHandle(impl->getStream(dev))};
}

}  // namespace

// One eager launch's native call (a plan and gate kind: addnorm.ops.triton.eager.EagerLaunch).
struct NativePlan : torch::CustomClassHolder {
  // the forward
  int64_t n = 0, block_m = 1, per_row = 0;
  bool store_s = false, s_like_y = false, keep_x = false, keep_r = false, save_y = false, prenorm = false;
  at::ScalarType y_dtype = at::kFloat, s_dtype = at::kFloat;
  // the backward, per spec (0: no gradient at s, 1: one at s)
  bool bwd_native[2] = {false, false};
  int64_t n_slices[2] = {1, 1}, bwd_block_m[2] = {1, 1}, one_program_rows[2] = {1, 1};
  int64_t grid_target[2] = {4, 4};
  bool need_dx[2] = {false, false}, need_x[2] = {false, false}, recompute[2] = {false, false};
  at::ScalarType x_dtype = at::kFloat, res_dtype = at::kFloat;
  std::vector<Kernel> kernels[3];  // forward, backward, backward with ds
  py::object py_forward, py_backward;  // today's launchers (misses), or a test's CPU kernel
  int64_t native_launches = 0, python_launches = 0, id = 0;

  ~NativePlan() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      py_forward = py::object();
      py_backward = py::object();
    }
  }

  const Kernel* find(int which, const Key& key) const {
    for (const auto& k : kernels[which])
      if (k.key == key) return &k;
    return nullptr;
  }

  void launch(const Kernel& k, unsigned gx, unsigned gy, void* stream, const Tensor* slots, int64_t rows,
              int64_t per_program, int64_t seed) {
    uint64_t storage[MAX_PARAMS];
    void* ptrs[MAX_PARAMS];
    const size_t np = k.params.size();
    for (size_t i = 0; i < np; ++i) {
      const Param& p = k.params[i];
      uint64_t v = p.value;
      switch (p.kind) {
        case TENSOR: {
          const Tensor& t = slots[p.slot];
          v = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
          break;
        }
        case ROWS: v = static_cast<uint64_t>(rows); break;
        case PER_PROGRAM: v = static_cast<uint64_t>(per_program); break;
        case SEED: v = static_cast<uint64_t>(seed); break;
        default: break;
      }
      if (p.size == 4) v &= 0xffffffffull;  // an i32 (little-endian: the low bytes)
      storage[i] = v;
      ptrs[i] = &storage[i];
    }
    int rc = launch_fn()(k.function, gx, gy, 1, k.block_x, 1, 1, k.smem, stream, ptrs, nullptr);
    TORCH_CHECK(rc == 0, "addnorm native call: cuLaunchKernel failed (CUresult ", rc, ")");
    ++native_launches;
  }
};

namespace {

struct AddNormNode : public torch::autograd::Function<AddNormNode> {
  // optional tensors: an undefined Tensor argument would be taken for an input (custom_function.h)
  static variable_list forward(AutogradContext* ctx, int64_t plan_id, Tensor x, Tensor r, std::optional<Tensor> w_,
                               std::optional<Tensor> b_, std::optional<Tensor> g_, std::optional<Tensor> seed_,
                               int64_t seed_i);
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

std::mutex registry_mutex;
std::unordered_map<int64_t, c10::weak_intrusive_ptr<NativePlan>> registry;
int64_t next_id = 1;

c10::intrusive_ptr<NativePlan> plan_of(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(id);
  TORCH_CHECK(it != registry.end(), "addnorm native call: no plan ", id);
  auto p = it->second.lock();
  TORCH_CHECK(p, "addnorm native call: plan ", id, " is gone");
  return p;
}

variable_list AddNormNode::forward(AutogradContext* ctx, int64_t plan_id, Tensor x, Tensor r,
                                   std::optional<Tensor> w_, std::optional<Tensor> b_, std::optional<Tensor> g_,
                                   std::optional<Tensor> seed_, int64_t seed_i) {
  const Tensor w = w_.value_or(Tensor()), b = b_.value_or(Tensor()), g = g_.value_or(Tensor());
  const Tensor seed_t = seed_.value_or(Tensor());
  auto plan = plan_of(plan_id);
  NativePlan& P = *plan;
  const bool seed_int = !seed_t.defined() && seed_i >= 0;
  const int64_t rows = x.numel() / P.n;
  Tensor y, s, rstd;
  const Kernel* k = nullptr;
  Where where{0, nullptr};
  if (rows > 0 && x.is_contiguous() && r.is_contiguous() && aligned(x) && aligned(r) && aligned(w) &&
      aligned(b) && aligned(g)) {
    where = current();
    Key key{where.device, code(x), code(r), code(w), code(b), code(g), int_kind(rows), seed_int, 0, 0, 0, 0};
    k = P.find(0, key);
  }
  if (k != nullptr) {
    y = x.scalar_type() == P.y_dtype ? at::empty_like(x) : at::empty_like(x, x.options().dtype(P.y_dtype));
    if (P.store_s) s = P.s_like_y ? at::empty_like(y) : at::empty_like(y, y.options().dtype(P.s_dtype));
    if (P.per_row) rstd = at::empty({P.per_row * rows}, x.options().dtype(at::kFloat));
    const Tensor slots[10] = {x, r, w, b, g, seed_t, y, s, Tensor(), rstd};
    P.launch(*k, static_cast<unsigned>((rows + P.block_m - 1) / P.block_m), 1, where.stream, slots, rows, 0,
             seed_i);
  } else {  // today's launcher (compiling on a first call) or a test's CPU kernel
    py::gil_scoped_acquire gil;
    py::object seed = seed_t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(seed_t))
                      : seed_int        ? py::object(py::int_(seed_i))
                                        : py::object(py::none());
    auto opt = [](const Tensor& t) {
      return t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t)) : py::object(py::none());
    };
    py::tuple out = P.py_forward(opt(x), opt(r), opt(w), opt(b), opt(g), seed);
    auto tensor = [](py::handle h) { return h.is_none() ? Tensor() : THPVariable_Unpack(h.ptr()); };
    y = tensor(out[0]);
    s = tensor(out[1]);
    rstd = tensor(out[2]);
    ++P.python_launches;
  }
  ctx->save_for_backward({P.keep_x ? x : Tensor(), P.keep_r ? r : Tensor(), w, b, g, seed_t,
                          P.save_y ? y : s, rstd});
  ctx->saved_data["plan"] = plan_id;
  ctx->saved_data["seed"] = seed_int ? seed_i : int64_t(-1);
  if (P.prenorm) {
    ctx->set_materialize_grads(false);
    return {y, s};
  }
  return {y};
}

variable_list AddNormNode::backward(AutogradContext* ctx, variable_list grads) {
  auto plan = plan_of(ctx->saved_data["plan"].toInt());
  NativePlan& P = *plan;
  const int64_t seed_i = ctx->saved_data["seed"].toInt();
  auto saved_list = ctx->get_saved_variables();
  Tensor x = saved_list[0], r = saved_list[1], w = saved_list[2], b = saved_list[3], g = saved_list[4];
  Tensor seed_t = saved_list[5], saved = saved_list[6], stats = saved_list[7];
  Tensor dy = grads[0];
  Tensor ds = P.prenorm && grads.size() > 1 ? grads[1] : Tensor();
  if (!dy.defined()) dy = at::zeros_like(saved);  // only s was used (Pre-LN)
  // strided gradients (a sum's expanded ones) read as rows: a contiguous copy, as the launchers' as_rows
  if (!dy.is_contiguous()) dy = dy.contiguous();
  if (ds.defined() && !ds.is_contiguous()) ds = ds.contiguous();
  const int which = ds.defined() ? 1 : 0;
  const int64_t rows = dy.numel() / P.n;
  Tensor dx, dres, dw, db, dg;
  const Kernel* k = nullptr;
  Where where{0, nullptr};
  int64_t programs = 1, per_program = 0;
  Tensor kx = P.need_x[which] ? x : Tensor(), kr = P.recompute[which] ? r : Tensor();
  if (P.bwd_native[which] && rows > 0 && dy.is_contiguous() && (!ds.defined() || ds.is_contiguous()) &&
      (!kx.defined() || kx.is_contiguous()) && (!kr.defined() || kr.is_contiguous()) && aligned(dy) &&
      aligned(ds) && aligned(saved) && aligned(kx) && aligned(kr) && aligned(w) && aligned(b) && aligned(g) &&
      aligned(stats)) {
    const int64_t bm = P.bwd_block_m[which];
    const int64_t tiles = (rows + bm - 1) / bm;
    if (rows <= P.one_program_rows[which]) {
      per_program = tiles;
    } else {  // as addnorm.ops.launch_config._bwd_grid (the target given from the device)
      const int64_t t = std::max<int64_t>(1, std::min(tiles, P.grid_target[which]));
      per_program = (tiles + t - 1) / t;
      programs = (tiles + per_program - 1) / per_program;
    }
    where = current();
    Key key{where.device, which, code(dy), code(ds), code(saved), code(kx), code(kr), code(w), code(b), code(g),
            int_kind(rows) | (int_kind(per_program) << 3), seed_i >= 0};
    k = P.find(which + 1, key);
  }
  if (k != nullptr) {
    dres = dy.scalar_type() == P.res_dtype ? at::empty_like(dy) : at::empty_like(dy, dy.options().dtype(P.res_dtype));
    if (P.need_dx[which]) dx = at::empty_like(dres, dres.options().dtype(P.x_dtype));
    auto f32 = dy.options().dtype(at::kFloat);
    std::vector<int64_t> part = programs == 1 ? std::vector<int64_t>{P.n} : std::vector<int64_t>{programs, P.n};
    Tensor dw_part = w.defined() ? at::empty(part, f32) : Tensor();
    Tensor db_part = b.defined() ? at::empty(part, f32) : Tensor();
    Tensor dg_part = g.defined() ? at::empty(part, f32) : Tensor();
    const Tensor slots[17] = {dy, ds, saved, kx, kr, w, b, g, seed_t, Tensor(), stats, Tensor(), dx, dres,
                              dw_part, db_part, dg_part};
    P.launch(*k, static_cast<unsigned>(P.n_slices[which]), static_cast<unsigned>(programs), where.stream, slots,
             rows, per_program, seed_i);
    // as addnorm.ops.param_grads.param_grads
    if (programs > 1) {
      if (dw_part.defined()) dw_part = dw_part.sum(0);
      if (db_part.defined()) db_part = db_part.sum(0);
      if (dg_part.defined()) dg_part = dg_part.sum(0);
    }
    if (dw_part.defined()) dw = dw_part.scalar_type() == w.scalar_type() ? dw_part : dw_part.to(w.scalar_type());
    if (db_part.defined()) db = db_part.scalar_type() == b.scalar_type() ? db_part : db_part.to(b.scalar_type());
    if (dg_part.defined()) dg = (g.numel() == 1 ? dg_part.sum() : dg_part).reshape(g.sizes()).to(g.scalar_type());
  } else {
    py::gil_scoped_acquire gil;
    auto opt = [](const Tensor& t) {
      return t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t)) : py::object(py::none());
    };
    py::object seed = seed_t.defined() ? opt(seed_t) : seed_i >= 0 ? py::object(py::int_(seed_i)) : py::object(py::none());
    py::tuple out = P.py_backward(which, opt(dy), opt(ds), opt(saved), opt(x), opt(r), opt(w), opt(b), opt(g),
                                  seed, opt(stats));
    auto tensor = [](py::handle h) { return h.is_none() ? Tensor() : THPVariable_Unpack(h.ptr()); };
    dx = tensor(out[0]);
    dres = tensor(out[1]);
    dw = tensor(out[2]);
    db = tensor(out[3]);
    dg = tensor(out[4]);
    ++P.python_launches;
  }
  // one gradient per forward argument: (plan, x, residual, weight, bias, gate, seed tensor, seed value)
  return {Tensor(), dx.defined() ? dx : dres, dres, dw, db, dg, Tensor(), Tensor()};
}

std::optional<Tensor> unpack(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return THPVariable_Unpack(h.ptr());
}

// the Python entry: plan.call(x, residual, weight, bias, gate=None, seed=None) -> y or (y, s)
py::object call(NativePlan& P, py::handle x, py::handle r, py::handle w, py::handle b, py::handle g,
                py::handle seed) {
  std::optional<Tensor> seed_t;
  int64_t seed_i = -1;
  if (PyLong_Check(seed.ptr())) {
    seed_i = PyLong_AsLongLong(seed.ptr());
  } else if (!seed.is_none()) {
    seed_t = THPVariable_Unpack(seed.ptr());
  }
  variable_list out = AddNormNode::apply(P.id, THPVariable_Unpack(x.ptr()), THPVariable_Unpack(r.ptr()), unpack(w),
                                         unpack(b), unpack(g), seed_t, seed_i);
  if (!P.prenorm) return py::reinterpret_steal<py::object>(THPVariable_Wrap(out[0]));
  return py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(out[0])),
                        py::reinterpret_steal<py::object>(THPVariable_Wrap(out[1])));
}

// the dispatcher's op (torch.ops.addnorm_native.add_norm): the same node
std::vector<Tensor> op(int64_t plan_id, const Tensor& x, const Tensor& r, const std::optional<Tensor>& w,
                       const std::optional<Tensor>& b, const std::optional<Tensor>& g,
                       const std::optional<Tensor>& seed_t, int64_t seed_i) {
  return AddNormNode::apply(plan_id, x, r, w, b, g, seed_t, seed_i);
}

// Tests on the CPU: a CUDA device guard (device 0, one stream) where the torch build has none.
struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  int64_t stream_handle;
  explicit FakeCudaGuard(int64_t s) : stream_handle(s) {}
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return {c10::DeviceType::CUDA, 0}; }
  c10::Device getDevice() const override { return {c10::DeviceType::CUDA, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::UNSAFE, d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void* getStreamNativeHandle(const c10::Stream) const override { return reinterpret_cast<void*>(stream_handle); }
};

bool install_fake_cuda_guard(int64_t stream) {
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return false;
  static c10::impl::DeviceGuardImplRegistrar reg(c10::DeviceType::CUDA, new FakeCudaGuard(stream));
  return true;
}

}  // namespace

TORCH_LIBRARY(addnorm_native, m) {
  m.def("add_norm(int plan, Tensor x, Tensor residual, Tensor? weight, Tensor? bias, Tensor? gate, "
        "Tensor? seed, int seed_value) -> Tensor[]");
  m.impl("add_norm", c10::DispatchKey::Autograd, TORCH_FN(op));
  m.impl("add_norm", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(op));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NativePlan, c10::intrusive_ptr<NativePlan>>(m, "NativePlan")
      .def(py::init([] { return c10::make_intrusive<NativePlan>(); }))
      .def_readwrite("n", &NativePlan::n)
      .def_readwrite("block_m", &NativePlan::block_m)
      .def_readwrite("per_row", &NativePlan::per_row)
      .def_readwrite("store_s", &NativePlan::store_s)
      .def_readwrite("s_like_y", &NativePlan::s_like_y)
      .def_readwrite("keep_x", &NativePlan::keep_x)
      .def_readwrite("keep_r", &NativePlan::keep_r)
      .def_readwrite("save_y", &NativePlan::save_y)
      .def_readwrite("prenorm", &NativePlan::prenorm)
      .def_readwrite("py_forward", &NativePlan::py_forward)
      .def_readwrite("py_backward", &NativePlan::py_backward)
      .def_readonly("native_launches", &NativePlan::native_launches)
      .def_readonly("python_launches", &NativePlan::python_launches)
      .def("set_dtypes", [](NativePlan& P, py::object y, py::object s, py::object x, py::object res) {
        P.y_dtype = dtype_of(y);
        P.s_dtype = dtype_of(s);
        P.x_dtype = dtype_of(x);
        P.res_dtype = dtype_of(res);
      })
      .def("set_backward", [](NativePlan& P, int which, bool native, int64_t n_slices, int64_t block_m,
                              int64_t one_program_rows, int64_t grid_target, bool need_dx, bool need_x,
                              bool recompute) {
        TORCH_CHECK(which == 0 || which == 1);
        P.bwd_native[which] = native;
        P.n_slices[which] = n_slices;
        P.bwd_block_m[which] = block_m;
        P.one_program_rows[which] = one_program_rows;
        P.grid_target[which] = grid_target;
        P.need_dx[which] = need_dx;
        P.need_x[which] = need_x;
        P.recompute[which] = recompute;
      })
      .def("add_kernel", [](NativePlan& P, int which, std::vector<int64_t> key, uint64_t function, unsigned block_x,
                            unsigned smem, std::vector<std::tuple<int, int, int, uint64_t>> params) {
        TORCH_CHECK(which >= 0 && which < 3 && key.size() == KEY && params.size() <= MAX_PARAMS);
        Kernel k;
        std::copy(key.begin(), key.end(), k.key.begin());
        k.function = reinterpret_cast<void*>(function);
        k.block_x = block_x;
        k.smem = smem;
        for (auto& [kind, size, slot, value] : params)
          k.params.push_back({static_cast<int8_t>(kind), static_cast<int8_t>(size), static_cast<int16_t>(slot), value});
        P.kernels[which].push_back(std::move(k));
      })
      .def_readonly("id", &NativePlan::id)
      .def("call", &call, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("bias"),
           py::arg("gate") = py::none(), py::arg("seed") = py::none())
      .def("n_kernels", [](const NativePlan& P, int which) { return P.kernels[which].size(); });
  m.def("register_plan", [](c10::intrusive_ptr<NativePlan> p) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    int64_t id = next_id++;
    registry.emplace(id, c10::weak_intrusive_ptr<NativePlan>(p));
    p->id = id;
    return id;
  });
  m.def("dtype_code", [](py::object d) { return static_cast<int64_t>(dtype_of(d)); });
  m.def("install_fake_cuda_guard", &install_fake_cuda_guard);
}
