// Parameters <-> safetensors files of full tensors (contract in include/meshgrad/checkpoint/parameter_file.hpp).
#include "meshgrad/checkpoint/parameter_file.hpp"

#include <set>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/p2p.hpp"

namespace meshgrad::checkpoint {

namespace {

// Every parameter pointer set, defined, with a unique name; "" when so, else what is wrong. Checked
// identically on every rank before any collective, so misuse throws everywhere instead of leaving
// peers waiting.
std::string param_problem(const std::vector<nn::Parameter*>& params) {
  std::set<std::string> names;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const nn::Parameter* p = params[i];
    if (p == nullptr) return fmt::format("parameter #{} is a null pointer", i);
    if (!p->value.defined()) return fmt::format("parameter '{}' has no value", p->name);
    if (!names.insert(p->name).second) return fmt::format("two parameters are named '{}'", p->name);
  }
  return {};
}

void check_params(const std::string& path, const std::vector<nn::Parameter*>& params, const char* op) {
  if (const std::string problem = param_problem(params); !problem.empty())
    throw io::SafetensorsError(path, fmt::format("{}: {}", op, problem));
}

// The shape of this rank's piece of p; sets *problem when p's placements do not fit its full shape.
Shape local_shape(const nn::Parameter& p, const dist::ProcessGroup&, std::string* problem) {
  try {
    return p.layout().local_shape;
  } catch (const InvalidArgument& e) {
    *problem = e.what();
  }
  return p.full_shape;
}

}  // namespace

void load_parameters(const std::string& path, const std::vector<nn::Parameter*>& params,
                     const dist::ProcessGroup& tp, const std::string& file_prefix) {
  check_params(path, params, "load_parameters");
  const io::SafetensorsFile file(path);

  // Pass 1: check every parameter against the header, so a bad file changes nothing.
  for (const nn::Parameter* p : params) {
    const std::string name = file_prefix + p->name;
    if (!file.contains(name))
      throw io::SafetensorsError(path, fmt::format("load_parameters: no tensor named '{}' for parameter '{}' (the file "
                                               "has {} tensors)",
                                               name, p->name, file.names().size()));
    const io::SafetensorsEntry& e = file.entry(name);
    if (e.shape != p->full_shape)
      throw io::SafetensorsError(path, fmt::format("load_parameters: parameter '{}' expects full shape {} but the file's "
                                               "tensor '{}' has shape {}",
                                               p->name, shape_str(p->full_shape), name, shape_str(e.shape)));
    if (!e.readable)
      throw io::SafetensorsError(path, fmt::format("load_parameters: parameter '{}': the file's tensor '{}' has dtype {}, "
                                               "which meshgrad does not read (it reads F32, F64, I64, F16 and BF16)",
                                               p->name, name, e.stored));
    // Converting between float32 and float64 is what a user asks for when loading a float64
    // reference into a float32 model (or back); int64 data for a floating parameter (or the
    // reverse) is a wrong file, not a precision choice.
    const bool file_int = e.dtype == DType::Int64;
    const bool param_int = p->value.dtype() == DType::Int64;
    if (file_int != param_int)
      throw io::SafetensorsError(path, fmt::format("load_parameters: parameter '{}' is {} but the file's tensor is {}",
                                               p->name, dtype_name(p->value.dtype()), dtype_name(e.dtype)));
    std::string problem;
    const Shape expected_local = local_shape(*p, tp, &problem);
    if (!problem.empty())
      throw io::SafetensorsError(path, fmt::format("load_parameters: parameter '{}': {}", p->name, problem));
    if (p->value.shape() != expected_local)
      throw io::SafetensorsError(path, fmt::format("load_parameters: parameter '{}' has local shape {} but its full shape "
                                               "{} sharded {} over tp={} gives {} on rank {}",
                                               p->name, shape_str(p->value.shape()), shape_str(p->full_shape),
                                               dist::placements_str(p->placements), tp.size(), shape_str(expected_local), tp.rank()));
  }

  // Pass 2: read, convert (see above), keep this rank's shard and copy it into the leaf's storage.
  // detach() shares the storage without the autograd state, so nothing is recorded; it also
  // shares the version counter, which copy_from bumps, so a graph that saved the old values
  // refuses to backpropagate through the loaded ones.
  autograd::NoGradGuard no_grad;
  for (nn::Parameter* p : params) {
    Tensor full = file.get(file_prefix + p->name).to(p->value.dtype());
    Tensor shard = nn::take_shard(full, *p);
    p->value.detach().copy_from(shard);
  }
}

namespace {

// A pipeline's later stage hands its full tensors to stage 0's writer: their count, then per tensor
// its name (int64 words), dtype, shape, then the data. Tags above dist::tags_for's range.
constexpr int kTagHeader = 32100, kTagData = 32101;

void send_full_tensors(const std::vector<std::pair<std::string, Tensor>>& full, const dist::ProcessGroup& stages) {
  std::vector<std::int64_t> header{static_cast<std::int64_t>(full.size())};
  for (const auto& [name, t] : full) {
    header.push_back(static_cast<std::int64_t>(name.size()));
    for (const char c : name) header.push_back(static_cast<unsigned char>(c));
    header.push_back(static_cast<std::int64_t>(t.dtype()));
    header.push_back(t.dim());
    for (const std::int64_t d : t.shape()) header.push_back(d);
  }
  const std::int64_t words[1] = {static_cast<std::int64_t>(header.size())};
  dist::send_async(Tensor::from_int64(words, {1}), stages, 0, kTagHeader).wait();
  dist::send_async(Tensor::from_int64(header, {static_cast<std::int64_t>(header.size())}), stages, 0, kTagHeader).wait();
  for (const auto& [name, t] : full) dist::send_async(t, stages, 0, kTagData).wait();
}

std::vector<std::pair<std::string, Tensor>> receive_full_tensors(const dist::ProcessGroup& stages, int from) {
  const std::int64_t n = dist::recv({1}, DType::Int64, stages, from, kTagHeader).to_int64_vector()[0];
  const std::vector<std::int64_t> h = dist::recv({n}, DType::Int64, stages, from, kTagHeader).to_int64_vector();
  std::vector<std::pair<std::string, Tensor>> out;
  std::size_t i = 1;
  for (std::int64_t k = 0; k < h[0]; ++k) {
    std::string name;
    for (std::int64_t c = h[i++]; c > 0; --c) name.push_back(static_cast<char>(h[i++]));
    const auto dtype = static_cast<DType>(h[i++]);
    Shape shape;
    for (std::int64_t d = h[i++]; d > 0; --d) shape.push_back(h[i++]);
    out.emplace_back(std::move(name), dist::recv(shape, dtype, stages, from, kTagData));
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> gather_full_parameters(const std::vector<nn::Parameter*>& params,
                                                                   const dist::ProcessGroup& tp, int writer_rank,
                                                                   const dist::ProcessGroup* stages) {
  if (writer_rank < 0 || writer_rank >= tp.size())
    throw InvalidArgument(fmt::format("gather_full_parameters: writer rank {} is not a rank of the {} group of size {}",
                                      writer_rank, tp.axis, tp.size()));
  if (const std::string problem = param_problem(params); !problem.empty())
    throw InvalidArgument(fmt::format("gather_full_parameters: {}", problem));
  autograd::NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> full;
  full.reserve(params.size());
  for (const nn::Parameter* p : params) full.emplace_back(p->name, nn::gather_full(p->value.detach(), *p));
  if (tp.rank() != writer_rank) return {};
  if (stages != nullptr && stages->size() > 1) full = collect_on_first_stage(std::move(full), *stages);
  return full;
}

void save_parameters(const std::string& path, const std::vector<nn::Parameter*>& params,
                     const dist::ProcessGroup& tp, int writer_rank,
                     const std::map<std::string, std::string>& metadata, const dist::ProcessGroup* stages) {
  if (writer_rank < 0 || writer_rank >= tp.size())
    throw io::SafetensorsError(path, fmt::format("save_parameters: writer rank {} is not a rank of the {} group of "
                                             "size {}",
                                             writer_rank, tp.axis, tp.size()));
  check_params(path, params, "save_parameters");
  const std::vector<std::pair<std::string, Tensor>> full = gather_full_parameters(params, tp, writer_rank, stages);
  const bool writes = tp.rank() == writer_rank && (stages == nullptr || stages->rank() == 0);
  if (writes) io::write_safetensors(path, full, metadata);
}

std::vector<std::pair<std::string, Tensor>> collect_on_first_stage(std::vector<std::pair<std::string, Tensor>> full,
                                                                   const dist::ProcessGroup& stages) {
  if (stages.size() == 1) return full;
  if (stages.rank() != 0) {
    send_full_tensors(full, stages);
    return {};
  }
  for (int s = 1; s < stages.size(); ++s) {
    for (auto& entry : receive_full_tensors(stages, s)) full.push_back(std::move(entry));
  }
  return full;
}

std::vector<std::pair<std::string, Tensor>> gather_gradients(const std::vector<nn::Parameter*>& params,
                                                             const dist::ProcessGroup& tp) {
  if (const std::string problem = param_problem(params); !problem.empty())
    throw InvalidArgument(fmt::format("gather_gradients: {}", problem));
  autograd::NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> out;
  out.reserve(params.size());
  for (const nn::Parameter* p : params) {
    Tensor grad = p->value.grad();
    if (!grad.defined()) grad = Tensor::zeros(p->value.shape(), p->value.dtype());
    // gather_full returns the local tensor itself when nothing is gathered; clone so that the
    // caller's dump does not alias (and later see changes to) the live .grad.
    Tensor gathered = nn::gather_full(grad.detach(), *p);
    out.emplace_back(p->name, gathered.storage() == grad.storage() ? gathered.clone() : gathered);
  }
  return out;
}

}  // namespace meshgrad::checkpoint
