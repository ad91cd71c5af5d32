#!/usr/bin/env bash
# ci/v2tests.sh: the cgroup tests on cgroup v2, run inside ci/v2guest.sh's guest (as root)
# twice, the way ci/test.sh's v2 stage does:
#   root     the worker in the root cgroup: CgroupPool makes its pools there (the root
#            is exempt from the no-internal-processes rule), and tests/test_cgroups.py
#            makes cgroups of its own to try the room a worker makes, a process of
#            someone else's, a cgroup given no memory or no pids, a cgroup namespace;
#   service  the worker in a non-root cgroup that also holds another process, as under
#            systemd: a unit's cgroup holding a shell that stays (its main process) and a
#            child of that shell, with pytest below it. Every pool moves that process tree
#            into a leaf and makes its cgroups beside it; the tests are the issue's list:
#            kernel accounting per env, memory_limit's OOM named on the lane, pids.max
#            against a fork bomb and the pool's cap, the freezer gate, cleanup after close
#            and after SIGKILL of client and worker, doctor, the template's cgroups, a
#            remote worker's pool cap.
# The guest is emulated (~10x slower than this machine, more when it is loaded), so each
# run takes a chosen set, mostly in template mode (the default spawn mode; exec mode's
# cgroup handling is the same code, and its tests run on the v1 host): about 4-5 min each.
# Not here: test_fork_bomb_hits_its_pids_limit_and_disturbs_nobody, whose bomb retries its
# refused forks forever; emulated, that takes every vCPU and the next pool cannot start
# (pids.max against forks is test_an_env_that_dies_at_its_pids_limit_says_so and the pool
# cap test instead).
#
# A third run, in a guest booted with systemd as PID 1 (V2GUEST_INIT=systemd, where COMMAND
# is the service v2guest.service):
#   systemd  tests/test_systemd.py: trainers placed by systemd-run in scopes systemd did not
#            delegate (beside a process of another tree; alone, with the default
#            OOMPolicy=stop) and in a user's login session; each worker asks systemd for a
#            delegated scope of its own. The guest starts only v2guest.service, so this run
#            first starts what a node runs anyway: the system bus (dbus.socket) and logind,
#            and makes the session's user (the guest's files are a throwaway overlay), who
#            must reach the interpreter under /root and the checkout, and whose manager lingers.
# Usage: bash ci/v2tests.sh [root|service|systemd]... (default: root and service in a bash-init
# guest, systemd in a systemd one). Exit status: the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d /run/systemd/system ]; then
  [ "${*:-systemd}" = systemd ] || { echo "ci/v2tests.sh: in a systemd guest only the systemd run" >&2; exit 2; }
  set -- systemd
elif [ "$(cat /proc/self/cgroup)" != "0::/" ]; then
  echo "ci/v2tests.sh: run me in a cgroup v2 guest's root cgroup (ci/v2guest.sh)" >&2; exit 2
fi
# The per-test hang timeout (pyproject.toml: 300 s) scaled as the tests' deadlines are.
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=5 -o timeout=1800 -o faulthandler_timeout=1780)

# Both runs: kernel accounting per env, memory_limit's OOM on its lane, pids.max, the
# freezer gate, cleanup at close, the template's cgroups, cpu_budget (cpu.stat's usage_usec),
# cpu_share (the cpu controller, enabled for such a pool only).
COMMON_TESTS=(
  "tests/test_memory_and_gate.py::test_envs_per_gb_tracks_a_known_allocation[template]"
  "tests/test_memory_and_gate.py::test_memory_limit_kills_and_reports_oom[exec]"
  "tests/test_memory_and_gate.py::test_the_gate_freezes_work_an_env_leaves_running_after_its_reply[template]"
  "tests/test_limits.py::test_an_env_that_dies_at_its_pids_limit_says_so[template]"
  "tests/test_limits.py::test_memory_hog_is_oom_killed_by_name_and_never_swaps[template]"
  "tests/test_pool.py::test_close_leaves_nothing_behind[template]"
  "tests/test_template.py::test_each_child_is_born_in_its_own_cgroup"
  "tests/test_cpu_budget.py::test_a_spinning_step_is_killed_at_its_budget_and_the_others_answer[template]"
  "tests/test_cpu_share.py::test_a_lane_with_many_sessions_gets_one_share[template]"
  "tests/test_cpu_share.py::test_each_sandbox_has_a_cpu_group_of_its_own_and_close_removes_them[exec]"
)
# The root run also: the room a worker makes, tried in cgroups test_cgroups.py makes itself
# (below the root, as systemd makes a unit's).
ROOT_TESTS=("${COMMON_TESTS[@]}" tests/test_cgroups.py
  --deselect "tests/test_cgroups.py::test_a_worker_in_a_cgroup_that_holds_processes_makes_room_and_undoes_it[exec]")
# The non-root run also, where v2 used to fail: the pool's pids cap, cleanup after SIGKILL
# of client and worker, doctor's trials, the PSS fallback, a remote pool's caps, the pool's
# cap named when envs reach it while starting.
SERVICE_TESTS=(
  "${COMMON_TESTS[@]}"
  "tests/test_limits.py::test_envs_that_together_pass_the_pool_cap_stop_there_and_other_pools_do_not_notice[template]"
  "tests/test_limits.py::test_close_and_hard_reset_reap_children_that_ignore_signals[template]"
  "tests/test_limits.py::test_no_sandbox_outlives_a_killed_client_or_worker[template-client-False]"
  "tests/test_limits.py::test_no_sandbox_outlives_a_killed_client_or_worker[template-worker-True]"
  "tests/test_limits.py::test_no_sandbox_outlives_a_killed_client_or_worker[exec-both-False]"
  "tests/test_protocol.py::test_a_killed_workers_cgroups_are_removed_by_its_guardian_without_the_client[True]"
  "tests/test_cli.py::test_doctor_passes_here_and_names_the_cgroup_version"
  "tests/test_memory_and_gate.py::test_without_a_writable_cgroup_memory_falls_back_to_pss[template]"
  "tests/test_remote.py::test_a_remote_pool_gets_the_ceilings_when_it_asks_for_nothing[template]"
  "tests/test_limits.py::test_an_env_that_dies_at_a_limit_while_starting_is_told_which_limit_to_raise[template-pool_pids]"
)

status=0
run() {  # run <label> <command...>: keep the first failure
  echo "ci/v2tests.sh: $1" >&2
  shift
  "$@"
  local rc=$?
  echo "ci/v2tests.sh: exit $rc" >&2
  if [ "$status" = 0 ]; then status=$rc; fi
}

for where in ${@:-root service}; do
  case $where in
    root) run "worker in the root cgroup" "${pytest[@]}" "${ROOT_TESTS[@]}" ;;
    service)
      # A unit's cgroup, given memory, pids and cpu by its parent as systemd's Delegate=yes does.
      unit=/sys/fs/cgroup/system.slice/boltzlabs-ci.service
      mkdir -p "$unit"
      echo "+memory +pids +cpu" > /sys/fs/cgroup/system.slice/cgroup.subtree_control
      # The shell stays in the unit (its main process) with a child of its own; pytest runs below it.
      run "worker in a non-root cgroup with another process" bash -c '
        echo $$ > "$1/cgroup.procs" || exit 1
        sleep 100000 & helper=$!
        shift
        "$@"; rc=$?
        kill $helper
        exit $rc' v2tests "$unit" "${pytest[@]}" "${SERVICE_TESTS[@]}" ;;
    systemd)
      [ -d /run/systemd/system ] || { echo "ci/v2tests.sh: the systemd run needs V2GUEST_INIT=systemd" >&2; exit 2; }
      systemctl start dbus.socket systemd-logind.service || exit 1
      user=boltzlabs-trainee
      id "$user" >/dev/null 2>&1 || useradd --create-home --uid 4242 "$user" || exit 1
      chmod o+x /root  # the interpreter is under /root/.pyenv (0755 inside)
      # The user runs this checkout's .venv: every directory above it lets the user through (a
      # checkout made in a `mktemp -d` is under a 0700 one). The overlay's copy; the host's stays.
      dir=$PWD
      while [ "$dir" != / ]; do chmod o+x "$dir" || exit 1; dir=$(dirname "$dir"); done
      # The user's manager stays up between tests: without lingering it stops 10 s after a
      # test's session ends, and a session opened while it stops finds its bus refusing.
      loginctl enable-linger "$user" || exit 1
      run "trainers under systemd, as root and as a user in a session" \
        env BOLTZLABS_TEST_SESSION_USER="$user" "${pytest[@]}" tests/test_systemd.py ;;
    *) echo "ci/v2tests.sh: unknown run $where (root, service, systemd)" >&2; exit 2 ;;
  esac
done
exit "$status"
