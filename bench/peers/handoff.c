// Physical-limit probe for small collectives: two threads pinned to cores 0 and 1 hand a flag back and
// forth (each waits for its turn spinning, then, with BYTES > 0, copies BYTES the other wrote into its
// own buffer and hands over). Prints the one-way hand-off time: what any shared-memory rendezvous of
// two ranks on different cores costs at least, and with BYTES what pulling that many bytes from the
// other core's cache adds. Usage: handoff [BYTES] (default 0; at most 65536).
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static _Alignas(64) _Atomic long turn = 0;
static _Alignas(64) char buf[2][65536];
static const long rounds = 200000;
static size_t bytes = 0;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void* run(void* arg) {
  const long me = (long)arg;
  cpu_set_t set; CPU_ZERO(&set); CPU_SET(me, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  for (long i = 0; i < rounds; i++) {
    const long mine = 2 * i + me;
    while (atomic_load_explicit(&turn, memory_order_acquire) != mine) __builtin_ia32_pause();
    if (bytes) memcpy(buf[me], buf[1 - me], bytes);
    atomic_store_explicit(&turn, mine + 1, memory_order_release);
  }
  return NULL;
}
int main(int argc, char** argv) {
  if (argc > 1) bytes = strtoul(argv[1], NULL, 10);
  if (bytes > sizeof buf[0]) { fprintf(stderr, "handoff: at most %zu bytes\n", sizeof buf[0]); return 2; }
  pthread_t t[2];
  const double t0 = now();
  for (long i = 0; i < 2; i++) pthread_create(&t[i], NULL, run, (void*)i);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  printf("handoff %zu B: %.0f ns one way (cores 0 and 1)\n", bytes, (now() - t0) / (2.0 * rounds) * 1e9);
  return 0;
}
