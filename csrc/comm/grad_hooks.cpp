// See Note [Gradient hooks in C++] in grad_hooks.h.
#include "grad_hooks.h"

#include <algorithm>
#include <mutex>

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace py = pybind11;
using torch::autograd::variable_list;

namespace shardopt {

struct GradHooks::State {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> views;
  std::shared_ptr<BucketEngine> engine;
  GradRoute route;
  py::object begin;
  std::mutex mu;
  std::mutex begin_mu;
  int pass_id = -1;  // autograd graph task of the current pass (-1: none)
  PassMode mode = PassMode::kIgnore;
  // kBeforeAccumulation (Note [Stage 3's gradient hooks in C++]).
  std::vector<std::vector<int64_t>> param_buckets;
  std::vector<int64_t> pending;   // per bucket: parameters still without a gradient (-1: not counted)
  bool armed = false;
  py::object bucket_done;

  ~State() {
    py::gil_scoped_acquire gil;
    begin = py::object();
    bucket_done = py::object();
  }

  // A new graph task is a new backward pass: ask Python once what it does.
  // `begin_mu` serialises the call into Python; `mu` is never held while Python runs (it may arm or disarm).
  PassMode mode_for_pass() {
    const int id = torch::autograd::get_current_graph_task_id();
    std::lock_guard<std::mutex> b(begin_mu);
    {
      std::lock_guard<std::mutex> g(mu);
      if (id == pass_id && id != -1) return mode;
    }
    PassMode m;
    {
      py::gil_scoped_acquire gil;
      m = static_cast<PassMode>(begin().cast<int64_t>());
    }
    std::lock_guard<std::mutex> g(mu);
    mode = m;
    pass_id = id;
    return m;
  }

  void on_grad(int64_t i) {
    PassMode m;
    {
      std::lock_guard<std::mutex> g(mu);
      m = mode;
    }
    if (m == PassMode::kIgnore) return;
    at::Tensor& p = params[i];
    if (m == PassMode::kNoteUsed) {
      engine->note_used(i);
      return;
    }
    const at::Tensor grad = p.grad();
    if (!grad.defined()) return;
    engine->mark_ready(i, grad);
    if (route == GradRoute::kKeepInFlatBuffer) {
      if (!grad.is_same(views[i])) p.mutable_grad() = views[i];  // the engine copied its value in
    } else {
      p.mutable_grad() = at::Tensor();  // the full-size gradient is released here
    }
  }

  // kBeforeAccumulation (Note [Stage 3's gradient hooks in C++]): the gradient goes where
  // AccumulateGrad's post hook would have sent it, and AccumulateGrad gets none.
  at::Tensor take(int64_t i, const at::Tensor& incoming) {
    const PassMode m = mode_for_pass();
    if (m == PassMode::kIgnore) return incoming;
    at::Tensor& p = params[i];
    at::Tensor held = p.grad();  // a gradient kept from earlier backwards (no_sync), whole
    if (m == PassMode::kNoteUsed) {
      // Accumulates locally as AccumulateGrad would; a copy, since autograd may reuse `incoming`.
      p.mutable_grad() = held.defined() ? held + incoming : incoming.clone(at::MemoryFormat::Contiguous);
      engine->note_used(i);
    } else {
      engine->mark_ready(i, held.defined() ? held + incoming : incoming);
      if (held.defined()) p.mutable_grad() = at::Tensor();
    }
    count_down(i);
    return at::Tensor();
  }

  // kBeforeAccumulation: parameter i has its gradient of this backward; a bucket whose parameters all have theirs goes.
  void count_down(int64_t i) {
    std::vector<int64_t> done;
    {
      std::lock_guard<std::mutex> g(mu);
      if (!armed) return;
      for (int64_t b : param_buckets[i]) {
        int64_t& left = pending[b];
        if (left > 0 && --left == 0) done.push_back(b);
      }
    }
    if (done.empty()) return;
    py::gil_scoped_acquire gil;
    for (int64_t b : done) bucket_done(b);
  }
};

namespace {

struct PreHook : torch::autograd::FunctionPreHook {
  explicit PreHook(std::shared_ptr<GradHooks::State> s) : state(std::move(s)) {}
  variable_list operator()(const variable_list& grads) override {
    state->mode_for_pass();
    return grads;
  }
  std::shared_ptr<GradHooks::State> state;
};

struct PostHook : torch::autograd::FunctionPostHook {
  PostHook(std::shared_ptr<GradHooks::State> s, int64_t i) : state(std::move(s)), index(i) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    state->on_grad(index);
    return outputs;
  }
  std::shared_ptr<GradHooks::State> state;
  int64_t index;
};

// Whether this backward runs the accumulator of parameter `p` (not so where torch.autograd.grad only
// captures its gradient, or backward(inputs=...) leaves it out).
bool runs_accumulator(const at::Tensor& p) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;  // .backward(): every node runs
  const auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
  if (!acc) return false;
  const auto it = exec_info->find(acc.get());
  return it != exec_info->end() && it->second.needed_;
}

// kBeforeAccumulation: a hook on the parameter itself (Note [Stage 3's gradient hooks in C++]).
struct TensorHook : torch::autograd::FunctionPreHook {
  TensorHook(std::shared_ptr<GradHooks::State> s, int64_t i) : state(std::move(s)), index(i) {}
  variable_list operator()(const variable_list& grads) override {
    if (grads.size() != 1 || !grads[0].defined() || !runs_accumulator(state->params[index])) return grads;
    return {state->take(index, grads[0])};
  }
  std::shared_ptr<GradHooks::State> state;
  int64_t index;
};

// Whether `h` is this state's hook of parameter i (by type and owner, not by address: a hook the list
// dropped is freed, and another may be allocated where it was).
bool is_ours(const torch::autograd::FunctionPreHook* h, const std::shared_ptr<GradHooks::State>& state,
             int64_t i) {
  const auto* ours = dynamic_cast<const TensorHook*>(h);
  return ours != nullptr && ours->state == state && ours->index == i;
}

// After whatever the tensor has (torch's add_hook insists on an empty list: it is how Python installs
// its one hook, the dict of the user's p.register_hook hooks, which then run before ours).
void append_hook(const at::Tensor& p, std::unique_ptr<torch::autograd::FunctionPreHook> hook) {
  TORCH_CHECK(torch::autograd::impl::get_autograd_meta(p), "a parameter that requires grad has autograd metadata");
  torch::autograd::impl::hooks(p).push_back(std::move(hook));
}

}  // namespace

GradHooks::GradHooks(std::vector<at::Tensor> params, std::shared_ptr<BucketEngine> engine,
                     std::vector<at::Tensor> views, GradRoute route, py::object begin)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(route != GradRoute::kKeepInFlatBuffer || views.size() == params.size(),
              "kKeepInFlatBuffer needs one gradient view per parameter");
  TORCH_CHECK(engine, "GradHooks need a bucket engine");
  state_->params = std::move(params);
  state_->views = std::move(views);
  state_->engine = std::move(engine);
  state_->route = route;
  state_->begin = std::move(begin);
  const auto& ps = state_->params;
  for (size_t i = 0; i < ps.size(); ++i) {
    TORCH_CHECK(ps[i].requires_grad() && ps[i].is_leaf(), "parameter ", i, " is not a leaf that requires grad");
    if (route == GradRoute::kBeforeAccumulation) {  // on the parameter itself (Note [Stage 3's gradient hooks in C++])
      append_hook(ps[i], std::make_unique<TensorHook>(state_, static_cast<int64_t>(i)));
      on_tensors_ = true;
      continue;
    }
    auto acc = torch::autograd::impl::grad_accumulator(ps[i]);
    TORCH_CHECK(acc, "parameter ", i, " has no gradient accumulator");
    auto pre = std::make_unique<PreHook>(state_);
    pre_hooks_.push_back(pre.get());
    acc->add_pre_hook(std::move(pre));
    post_keys_.push_back(acc->add_post_hook(std::make_unique<PostHook>(state_, static_cast<int64_t>(i))));
    // The variable holds its accumulator weakly: keep it, or a new one (without the hooks) replaces it.
    accumulators_.push_back(std::move(acc));
  }
}

GradHooks::~GradHooks() { remove(); }

void GradHooks::count_buckets(std::vector<std::vector<int64_t>> param_buckets, py::object bucket_done) {
  auto& s = *state_;
  TORCH_CHECK(s.route == GradRoute::kBeforeAccumulation, "GradHooks.count_buckets() is for hooks built with "
              "GradRoute.BEFORE_ACCUMULATION");
  TORCH_CHECK(param_buckets.size() == s.params.size(), "GradHooks.count_buckets(): one bucket list per parameter");
  std::lock_guard<std::mutex> g(s.mu);
  s.param_buckets = std::move(param_buckets);
  s.bucket_done = std::move(bucket_done);
}

void GradHooks::arm(std::vector<int64_t> pending) {
  std::lock_guard<std::mutex> g(state_->mu);
  for (const auto& buckets : state_->param_buckets) {
    for (int64_t b : buckets) {
      TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(pending.size()), "GradHooks.arm(): bucket ", b,
                  " of a parameter has no count (", pending.size(), " given)");
    }
  }
  state_->pending = std::move(pending);
  state_->armed = true;
}

int64_t GradHooks::ensure() {
  int64_t put_back = 0;
  const auto& ps = state_->params;
  if (!on_tensors_) return 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    // Nothing is accumulated into a stage-3 parameter, so such a hook would never run: refused, not ignored.
    TORCH_CHECK(!torch::autograd::impl::post_acc_grad_hooks(ps[i]), "stage 3: parameter ", i,
                " of the optimizer has a register_post_accumulate_grad_hook, which never runs at stage 3 (its "
                "gradient goes to the shard before any accumulation into the parameter); use p.register_hook "
                "(it sees the gradient first), or stage 1 or 2");
    const auto& hooks = torch::autograd::impl::hooks(ps[i]);
    const auto i64 = static_cast<int64_t>(i);
    if (std::any_of(hooks.begin(), hooks.end(), [&](const auto& h) { return is_ours(h.get(), state_, i64); })) {
      continue;
    }
    append_hook(ps[i], std::make_unique<TensorHook>(state_, i64));
    ++put_back;
  }
  return put_back;
}

void GradHooks::disarm() {
  std::lock_guard<std::mutex> g(state_->mu);
  state_->armed = false;
}

void GradHooks::remove() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    auto& acc = accumulators_[i];
    acc->del_post_hook(post_keys_[i]);
    auto& pres = acc->pre_hooks();
    for (auto it = pres.begin(); it != pres.end(); ++it) {
      if (it->get() == pre_hooks_[i]) {
        pres.erase(it);
        break;
      }
    }
  }
  for (size_t i = 0; i < (on_tensors_ ? state_->params.size() : 0); ++i) {
    auto& hooks = torch::autograd::impl::hooks(state_->params[i]);
    const auto i64 = static_cast<int64_t>(i);
    const auto ours = [&](const auto& h) { return is_ours(h.get(), state_, i64); };
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(), ours), hooks.end());
  }
  accumulators_.clear();
  pre_hooks_.clear();
  post_keys_.clear();
  on_tensors_ = false;
}

int64_t GradHooks::num_hooks() const {
  return 2 * static_cast<int64_t>(accumulators_.size()) +
         (on_tensors_ ? static_cast<int64_t>(state_->params.size()) : 0);
}

}  // namespace shardopt

namespace shardopt {

void set_grads(const std::vector<at::Tensor>& params, const std::vector<std::optional<at::Tensor>>& grads) {
  TORCH_CHECK(params.size() == grads.size(), "set_grads: ", params.size(), " parameters but ", grads.size(),
              " gradients");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& g = grads[i];
    if (g.has_value()) {
      TORCH_CHECK(g->sizes() == params[i].sizes() && g->dtype() == params[i].dtype() &&
                      g->device() == params[i].device(),
                  "set_grads: gradient ", i, " does not match its parameter's shape, dtype or device");
    }
    const_cast<at::Tensor&>(params[i]).mutable_grad() = g.has_value() ? *g : at::Tensor();
  }
}

}  // namespace shardopt
