// Metadata an upper layer attaches to a tensor without the tensor layer knowing what it means.
// distributed/ uses it for the placement of a gradient ("partial over the tp axis": the true gradient is
// the sum over that axis of the local ones), so redistribution backwards can be derived from the
// gradient that actually arrives.
//
// The autograd engine carries annotations along: gradients a node returns without one inherit the
// annotation of the gradients the node received (every backward formula is linear in the incoming
// gradient, so "partial" survives local ops), except from nodes that decide it themselves
// (Node::decides_gradient_placement: communication); when two gradients for one tensor are summed
// their annotations are combined (combine() throws when they cannot be summed meaningfully).
#pragma once

#include <memory>
#include <string>

namespace meshgrad {

class Annotation {
 public:
  virtual ~Annotation() = default;
  virtual std::string str() const = 0;
  // The annotation of a + b where a carries this and b carries other (other may be null).
  virtual std::shared_ptr<const Annotation> combine(const std::shared_ptr<const Annotation>& other) const = 0;
};
using AnnotationPtr = std::shared_ptr<const Annotation>;

// Combines two possibly-null annotations. A null one means "nothing said"; the non-null side
// decides whether it can be summed with that (combine(nullptr)).
inline AnnotationPtr combine_annotations(const AnnotationPtr& a, const AnnotationPtr& b) {
  if (!a && !b) return nullptr;
  if (!a) return b->combine(nullptr);
  return a->combine(b);
}

}  // namespace meshgrad
