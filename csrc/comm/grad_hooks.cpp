// See Note [Gradient hooks in C++] in grad_hooks.h.
#include "grad_hooks.h"

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
  int64_t stage;
  py::object begin;
  std::mutex mu;
  int pass_id = -1;  // autograd graph task of the current pass (-1: none)
  PassMode mode = PassMode::kIgnore;

  ~State() {
    py::gil_scoped_acquire gil;
    begin = py::object();
  }

  // A new graph task is a new backward pass: ask Python once what it does.
  PassMode mode_for_pass() {
    const int id = torch::autograd::get_current_graph_task_id();
    std::lock_guard<std::mutex> g(mu);
    if (id != pass_id || id == -1) {
      py::gil_scoped_acquire gil;
      mode = static_cast<PassMode>(begin().cast<int64_t>());
      pass_id = id;
    }
    return mode;
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
    if (stage == 1) {
      if (!grad.is_same(views[i])) p.mutable_grad() = views[i];  // the engine copied its value in
    } else {
      p.mutable_grad() = at::Tensor();  // stage 2: the full-size gradient is released here
    }
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

}  // namespace

GradHooks::GradHooks(std::vector<at::Tensor> params, std::shared_ptr<BucketEngine> engine,
                     std::vector<at::Tensor> views, int64_t stage, py::object begin)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(stage == 1 || stage == 2, "GradHooks serve stages 1 and 2, got stage ", stage);
  TORCH_CHECK(stage == 2 || views.size() == params.size(), "stage 1 needs one gradient view per parameter");
  TORCH_CHECK(engine, "GradHooks need a bucket engine");
  state_->params = std::move(params);
  state_->views = std::move(views);
  state_->engine = std::move(engine);
  state_->stage = stage;
  state_->begin = std::move(begin);
  const auto& ps = state_->params;
  for (size_t i = 0; i < ps.size(); ++i) {
    TORCH_CHECK(ps[i].requires_grad() && ps[i].is_leaf(), "parameter ", i, " is not a leaf that requires grad");
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
  accumulators_.clear();
  pre_hooks_.clear();
  post_keys_.clear();
}

int64_t GradHooks::num_hooks() const { return 2 * static_cast<int64_t>(accumulators_.size()); }

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
