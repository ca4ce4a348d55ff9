#include "meshgrad/launch/launch.hpp"

#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <mutex>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string_view>

#include "meshgrad/comm/errors.hpp"
#include "meshgrad/comm/mpi.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::launch {

namespace {

// A positive integer from the environment, or 0 when the variable is unset or not one.
int env_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return 0;
  int value = 0;
  const char* last = text + std::strlen(text);
  const auto [end, ec] = std::from_chars(text, last, value);
  return ec == std::errc() && end == last && value > 0 ? value : 0;
}

}  // namespace

namespace {

std::vector<OptionValue>& recorded_options() {
  static std::vector<OptionValue> options;
  return options;
}

std::string serialize(const std::vector<OptionValue>& options) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& o : options) j.push_back({o.name, o.value});
  return j.dump();
}

std::vector<OptionValue> deserialize(const std::string& text) {
  std::vector<OptionValue> out;
  for (const auto& item : nlohmann::json::parse(text)) out.push_back({item.at(0).get<std::string>(), item.at(1).get<std::string>()});
  return out;
}

// FNV-1a, 64 bits: the same on every rank and build (std::hash is neither), reinterpreted as int64
// for the collective.
std::int64_t fnv1a(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h);
}

// "" when a and b agree, else "--hidden is '32' on rank 0 but '64' on rank 1".
std::string first_difference(const std::vector<OptionValue>& a, int rank_a, const std::vector<OptionValue>& b,
                             int rank_b) {
  auto value_in = [](const std::vector<OptionValue>& options, const std::string& name) -> std::string {
    for (const auto& o : options) {
      if (o.name == name) return "'" + o.value + "'";
    }
    return "absent";
  };
  for (const auto& o : a) {
    const std::string va = "'" + o.value + "'", vb = value_in(b, o.name);
    if (va != vb) return fmt::format("{} is {} on rank {} but {} on rank {}", o.name, va, rank_a, vb, rank_b);
  }
  for (const auto& o : b) {
    if (value_in(a, o.name) == "absent") {
      return fmt::format("{} is absent on rank {} but '{}' on rank {}", o.name, rank_a, o.value, rank_b);
    }
  }
  return "";
}

}  // namespace

void set_launch_options(std::vector<OptionValue> options) { recorded_options() = std::move(options); }
const std::vector<OptionValue>& launch_options() { return recorded_options(); }

void agree_on_options(comm::Communicator& world, const std::vector<OptionValue>& options) {
  const int P = world.size();
  const std::string mine = serialize(options);
  const std::int64_t my_hash = fnv1a(mine);
  std::vector<std::int64_t> hashes(static_cast<std::size_t>(P));
  world.all_gather(comm::ConstBuffer{&my_hash, 1, DType::Int64}, comm::MutableBuffer{hashes.data(), hashes.size(), DType::Int64});
  if (std::all_of(hashes.begin(), hashes.end(), [&](std::int64_t h) { return h == hashes[0]; })) return;

  // Some rank differs: gather every rank's options (as int64 words) to name the option and values.
  const std::int64_t my_len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(P));
  world.all_gather(comm::ConstBuffer{&my_len, 1, DType::Int64}, comm::MutableBuffer{lengths.data(), lengths.size(), DType::Int64});
  std::vector<std::size_t> words(static_cast<std::size_t>(P));
  std::size_t total = 0;
  for (int r = 0; r < P; ++r) total += words[static_cast<std::size_t>(r)] = (static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]) + 7) / 8;
  std::vector<std::int64_t> my_words(words[static_cast<std::size_t>(world.rank())], 0);
  std::memcpy(my_words.data(), mine.data(), mine.size());
  std::vector<std::int64_t> all(total);
  world.all_gather(comm::ConstBuffer{my_words.data(), my_words.size(), DType::Int64},
               comm::MutableBuffer{all.data(), all.size(), DType::Int64}, words);
  std::vector<std::vector<OptionValue>> per_rank;
  std::size_t offset = 0;
  for (int r = 0; r < P; ++r) {
    const auto* bytes = reinterpret_cast<const char*>(all.data() + offset);
    per_rank.push_back(deserialize(std::string(bytes, static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]))));
    offset += words[static_cast<std::size_t>(r)];
  }
  // This rank's own difference from rank 0 when it has one, else the first rank that differs.
  int other = world.rank();
  if (hashes[static_cast<std::size_t>(other)] == hashes[0]) {
    other = static_cast<int>(std::find_if(hashes.begin(), hashes.end(), [&](std::int64_t h) { return h != hashes[0]; }) -
                             hashes.begin());
  }
  int differing = 0;
  for (std::int64_t h : hashes) differing += h != hashes[0];
  throw InvalidArgument(fmt::format("the {} ranks were started with different options: {} ({} of {} ranks differ from "
                                    "rank 0); start every rank with the same command line", world.backend(),
                                    first_difference(per_rank[0], 0, per_rank[static_cast<std::size_t>(other)], other),
                                    differing, P));
}

namespace {
char* g_out_of_memory_reserve = nullptr;
void give_back_reserve_and_fail() {
  delete[] g_out_of_memory_reserve;
  g_out_of_memory_reserve = nullptr;
  std::set_new_handler(nullptr);   // the next failure throws as usual
  throw std::bad_alloc();
}
}  // namespace

void reserve_memory_for_out_of_memory_errors() {
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr std::size_t kReserve = std::size_t{16} << 20;   // 16 MiB: far more than any unwinding needs
    g_out_of_memory_reserve = new char[kReserve];
    std::memset(g_out_of_memory_reserve, 0, kReserve);   // resident, not only reserved address space
    std::set_new_handler(give_back_reserve_and_fail);
  });
}

std::string error_message(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return fmt::format("out of memory ({}): the model, batch or data does not fit in this machine's memory (or the "
                       "process's limit); use a smaller --hidden, --layers, --seq or --batch, or fewer ranks per "
                       "machine", e.what());
  }
  return e.what();
}

int mpi_launcher_world_size() {
  // Open MPI's mpirun sets OMPI_COMM_WORLD_SIZE; PMI launchers (MPICH's hydra, srun) set PMI_SIZE.
  return std::max(env_count("OMPI_COMM_WORLD_SIZE"), env_count("PMI_SIZE"));
}

int mpi_ranks_on_this_node(int world_size) {
  const int local = std::max(env_count("OMPI_COMM_WORLD_LOCAL_SIZE"), env_count("MPI_LOCALNRANKS"));
  // Unknown: assume every rank shares this node, which never oversubscribes the cores.
  return local > 0 ? local : world_size;
}

int run_on_backend(const std::string& backend, int world_size,
                   const std::function<void(const comm::CommunicatorPtr& world)>& fn) {
  if (backend == "threads") {
    const int launched = mpi_launcher_world_size();
    MG_CHECK(launched <= 1, "--backend threads under mpirun: this is one of {} processes an MPI launcher started, "
             "and each would run the whole job on its own; add `--backend mpi` (or run without mpirun)", launched);
    MG_CHECK(world_size >= 1, "--backend threads: need at least one rank, got {}", world_size);
    // All ranks are threads of this process: they share the cores.
    blas::ThreadsPerRank blas_policy(world_size);
    blas::reserve_work_buffers(world_size * blas_policy.threads());
    comm::run_ranks(world_size, fn);   // rethrows the first rank's error after every rank joined
    return 0;
  }
  if (backend == "mpi") {
    int argc = 0;
    char** argv = nullptr;
    // Throws CommError naming the mpi backend (and how to build it) in a build without MPI.
    comm::MpiSession session(&argc, &argv);
    comm::CommunicatorPtr world = session.world();
    // One rank per process: the processes on this node share its cores.
    blas::ThreadsPerRank blas_policy(mpi_ranks_on_this_node(world->size()), /*ranks_in_process=*/1);
    MG_CHECK(world_size == 0 || world_size == world->size(),
             "--backend mpi: the mesh needs {} ranks but the MPI world has {} processes (start with "
             "`mpirun -np {} meshgrad ...`)",
             world_size, world->size(), world_size);
    try {
      blas::reserve_work_buffers(blas_policy.threads());   // a failure here aborts the job like any rank error
      if (world->size() > 1) agree_on_options(*world, launch_options());   // before any model is built
      fn(world);
    } catch (const std::exception& e) {
      if (world->size() == 1) throw;
      // The other ranks may be blocked in a collective this rank will never join; MPI cannot cancel
      // it and MPI_Finalize would wait for them, so the job is aborted with this rank's message.
      comm::mpi_abort(1, fmt::format("meshgrad: error on rank {} of {}: {}", world->rank(), world->size(),
                                      error_message(e)));
    }
    return 0;
  }
  throw InvalidArgument(fmt::format("unknown --backend '{}': choose threads or mpi", backend));
}

dist::DeviceMeshPtr make_mesh(const comm::CommunicatorPtr& world, const std::string& spec) {
  MG_CHECK(world != nullptr, "make_mesh: no communicator");
  auto axes = dist::parse_mesh(spec);
  const int size = dist::mesh_world_size(spec);
  MG_CHECK(size == world->size(), "--mesh {} needs {} ranks but the {} world has {}", spec, size, world->backend(),
           world->size());
  return std::make_shared<const dist::DeviceMesh>(world, std::move(axes));
}

dist::RunOnMesh mesh_runner(std::string backend, std::string mesh) {
  return [backend = std::move(backend), mesh = std::move(mesh)](
             const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    run_on_backend(backend, dist::mesh_world_size(mesh),
                   [&](const comm::CommunicatorPtr& world) { fn(make_mesh(world, mesh)); });
  };
}

}  // namespace meshgrad::launch
