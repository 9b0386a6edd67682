# Sourced by the scripts in ci/, from the repository root: what more than one of them reads the same way.

# made NAME: whether COMMFUSE_SET_UP names NAME, an environment ci/test.sh has made already (a stage whose
# environment is made skips its set-up)
made() {
    case " ${COMMFUSE_SET_UP:-} " in *" $1 "*) return 0 ;; esac
    return 1
}

# set_up NAME SCRIPT: runs ci/SCRIPT unless ci/test.sh made the environment NAME already
set_up() {
    made "$1" || bash "ci/$2"
}

# parallel: pytest-xdist's arguments for COMMFUSE_TEST_WORKERS workers (default 2; 0 runs the tests in one
# process), set as the array parallel
workers="${COMMFUSE_TEST_WORKERS:-2}"
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist worksteal)
