// Shim for Debian's libtorch-dev 1.13, which ships c10d/reducer.hpp but not the
// distributed-autograd header it includes. reducer.hpp only needs the context's pointer
// type (a std::shared_ptr, whose layout does not depend on the pointee) and its callback
// type; mgtrain never uses distributed autograd. Found only when the real header is
// absent (this directory comes after torch's in the include path).
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::distributed::autograd {
class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;
}  // namespace torch::distributed::autograd
