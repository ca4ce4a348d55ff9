#!/usr/bin/env bash
# Times the first run of a new user: `make train` from a fresh clone to its first training step, split
# into packages, configure, build and start; with --test, `make test` after it (packages, build, ctest).
#
#   bench/first_run.sh [--chroot DIR] [--test] [--log DIR] REPO
#
# REPO is cloned into a new folder (inside DIR with --chroot, whose proc, sys and dev this script
# mounts and unmounts; DIR is a Debian 12 made by `debootstrap --variant=minbase bookworm DIR`, which
# has no compiler, no make and no git: `make` and git, which a machine that ran `git clone` has, are
# installed first and timed as their own phase). Without --chroot the clone runs on this machine as
# it is, so the packages phase is only honest on a fresh machine.
# Every output line is stamped with the seconds since the start (logs in --log DIR, default a new
# temporary folder); the phases are read from the lines make echoes. `make train` is stopped once its
# first step is printed, and given up after FIRST_RUN_TIMEOUT seconds (default 3600) without one.
# Prints a table of the phases.
set -euo pipefail
chroot_dir="" run_test=0 log_dir=""
while [ $# -gt 1 ]; do
  case "$1" in
    --chroot) chroot_dir=$2; shift 2 ;;
    --test) run_test=1; shift ;;
    --log) log_dir=$2; shift 2 ;;
    *) echo "first_run: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ $# -eq 1 ] || { echo "usage: bench/first_run.sh [--chroot DIR] [--test] [--log DIR] REPO" >&2; exit 2; }
repo=$1
log_dir=${log_dir:-$(mktemp -d /tmp/first_run.XXXXXX)}
mkdir -p "$log_dir"

if [ -n "$chroot_dir" ]; then
  [ -x "$chroot_dir/bin/bash" ] || { echo "first_run: '$chroot_dir' is not a Debian root (no bin/bash)" >&2; exit 2; }
  clone_in_root=/root/meshgrad-first-run
  clone=$chroot_dir$clone_in_root
  # The root a mount point of its own, as a machine's is: `ip netns` (tests/cli/multihost.py) remounts it.
  mountpoint -q "$chroot_dir" || mount --bind "$chroot_dir" "$chroot_dir"
  for fs in proc sys dev; do mountpoint -q "$chroot_dir/$fs" || mount --rbind "/$fs" "$chroot_dir/$fs"; done
  trap 'for fs in dev sys proc; do umount -R -l "$chroot_dir/$fs" 2>/dev/null || true; done; umount -l "$chroot_dir" 2>/dev/null || true' EXIT
  cp /etc/resolv.conf "$chroot_dir/etc/resolv.conf"
  # This machine's name resolves locally (mpirun looks it up; through DNS each lookup would time out).
  cp /etc/hosts "$chroot_dir/etc/hosts"
  # What a machine of this kind has that debootstrap's Debian lacks: its local certificate
  # authorities (the registries are reached through them) and npm's setting that names them.
  if [ -d /usr/local/share/ca-certificates ]; then
    mkdir -p "$chroot_dir/usr/local/share/ca-certificates" "$chroot_dir/etc/ssl/certs"
    cp -a /usr/local/share/ca-certificates/. "$chroot_dir/usr/local/share/ca-certificates/"
    cp /etc/ssl/certs/ca-certificates.crt "$chroot_dir/etc/ssl/certs/ca-certificates.crt"
  fi
  [ -f /etc/npmrc ] && cp /etc/npmrc "$chroot_dir/etc/npmrc"
  # A clean environment, as a new login has; OPENBLAS_CORETYPE passes through when set (the tests' setting).
  env_in=(HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin)
  [ -n "${OPENBLAS_CORETYPE:-}" ] && env_in+=(OPENBLAS_CORETYPE="$OPENBLAS_CORETYPE")
  in_root() { chroot "$chroot_dir" /usr/bin/env -i "${env_in[@]}" bash -c "cd $clone_in_root && $1"; }
else
  clone=$(mktemp -d /tmp/first_run_clone.XXXXXX)/meshgrad
  in_root() { bash -c "cd '$clone' && $1"; }
fi
rm -rf "$clone"
git clone -q "$repo" "$clone"
echo "first_run: clone in $clone, logs in $log_dir" >&2

start=$EPOCHREALTIME
# stamp LOG: each line of stdin written to LOG as "<seconds since start> <line>".
stamp() { local line; while IFS= read -r line; do
  printf '%8.1f %s\n' "$(bc <<<"$EPOCHREALTIME - $start" 2>/dev/null || echo 0)" "$line"; done >"$1"; }
# first LOG PATTERN: the time of LOG's first line matching the extended regex PATTERN.
first() { grep -E -m1 -- "$2" "$1" | awk '{print $1}'; }
last() { grep -E -- "$2" "$1" | tail -1 | awk '{print $1}'; }

# Phase 0 (chroot only): make and git.
if [ -n "$chroot_dir" ]; then
  in_root "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends make git ca-certificates" 2>&1 | stamp "$log_dir/make.log"
fi
make_done=$(bc <<<"$EPOCHREALTIME - $start")

# stop_training: SIGTERM to the `meshgrad train` of this clone (its working directory), no other run on
# the machine. TERM, not INT: a background job of a non-interactive shell ignores SIGINT.
stop_training() {
  local pid
  for pid in $(pgrep -f 'build/meshgrad train' || true); do
    [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$clone" ] && kill -TERM "$pid" 2>/dev/null
  done
  return 0
}

# make train, stopped at its first step (or at the deadline).
set +e
in_root "exec make train" > >(stamp "$log_dir/train.log") 2>&1 &
train_pid=$!
deadline=$((SECONDS + ${FIRST_RUN_TIMEOUT:-3600}))
while kill -0 "$train_pid" 2>/dev/null; do
  if grep -Eq '^ *[0-9.]+ step +1/' "$log_dir/train.log" 2>/dev/null; then
    stop_training
    break
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "first_run: no first step after ${FIRST_RUN_TIMEOUT:-3600} s; stopping make train" >&2
    stop_training
    kill -TERM "$train_pid" 2>/dev/null
    break
  fi
  sleep 0.5
done
wait "$train_pid"
set -e
sleep 1
train_log=$log_dir/train.log
grep -Eq ' step +1/' "$train_log" || { echo "first_run: make train printed no first step; see $train_log" >&2; exit 1; }
configure_start=$(first "$train_log" ' cmake -S ')
configure_done=$(first "$train_log" 'Build files have been written')
build_done=$(last "$train_log" 'Built target meshgrad_cli')
first_step=$(first "$train_log" ' step +1/')
compiles=$(grep -Ec 'Building CXX object' "$train_log" || true)

printf '\n| phase of `make train` | from the start (s) |\n|---|---:|\n'
[ -n "$chroot_dir" ] && printf '| `make` and git installed | %.1f |\n' "$make_done"
printf '| build packages installed | %s |\n| CMake configured | %s |\n| program built (%s compiles) | %s |\n| **first training step printed** | **%s** |\n' \
  "$configure_start" "$configure_done" "$compiles" "$build_done" "$first_step"

if [ "$run_test" = 1 ]; then
  start=$EPOCHREALTIME
  set +e
  in_root "exec make test" 2>&1 | stamp "$log_dir/test.log"
  test_rc=${PIPESTATUS[0]}
  set -e
  test_log=$log_dir/test.log
  t_configure=$(first "$test_log" ' cmake -S ')
  t_build=$(first "$test_log" 'ctest --output-on-failure')
  t_end=$(tail -1 "$test_log" | awk '{print $1}')
  summary=$(grep -E 'tests passed' "$test_log" | tail -1 | cut -c10-)
  printf '\n| phase of `make test` (after `make train`) | from its start (s) |\n|---|---:|\n'
  printf '| test packages installed (and test data fetched) | %s |\n| everything built | %s |\n| **ctest done** (%s; exit %s) | **%s** |\n' \
    "$t_configure" "$t_build" "$summary" "$test_rc" "$t_end"
fi
