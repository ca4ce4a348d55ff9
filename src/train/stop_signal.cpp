#include "meshgrad/train/stop_signal.hpp"

#include <csignal>
#include <mutex>

namespace meshgrad::train {

namespace {

volatile std::sig_atomic_t g_requested = 0;
std::mutex g_mutex;
int g_scopes = 0;
struct sigaction g_old_term {}, g_old_int {};

void on_signal(int sig) {
  if (sig == SIGINT && g_requested != 0) {
    // The second Ctrl-C: the user does not want to wait for the checkpoint.
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  g_requested = sig;
}

}  // namespace

StopSignalScope::StopSignalScope() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (g_scopes++ > 0) return;
  g_requested = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;   // a write or a wait interrupted by the signal carries on
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

StopSignalScope::~StopSignalScope() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (--g_scopes > 0) return;
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

int stop_requested() { return g_requested; }
void clear_stop_request() { g_requested = 0; }

}  // namespace meshgrad::train
