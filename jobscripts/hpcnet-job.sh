# The part of a batch job that every jobscripts/*.sbatch shares; sourced by them,
# not submitted itself.  `hpcnet_job "$@"` runs hpcnet.train over the allocation,
# supervised, and requeues the job when that can help:
#
#   exit status of the training            what the job does
#   0   finished                             ends
#   76  preempted (checkpoint saved)         requeues itself; the requeued job resumes
#   75  restartable, or a rank was killed    hpcnet.launch retries inside the allocation
#       (SIGKILL, SIGSEGV, SIGBUS, SIGABRT)  first; when its restarts are spent, requeue
#   1, 2, 130, ...  bug, bad input, Ctrl-C   ends (a restart cannot help)
#
# Requeues are counted by SLURM (SLURM_RESTART_COUNT) and stop at
# HPCNET_MAX_REQUEUES.  A job that SLURM itself ends (scancel, `scontrol requeue`,
# preemption, the time limit) gets SIGTERM in every process: hpcnet saves at the next
# step boundary and exits 76, and the job does not requeue itself; SLURM requeues
# it if that is what it is doing.
#
# Settings (environment, all optional; sbatch passes the submitting shell's):
#   HPCNET_LAUNCHER      srun (default: `srun --mpi=pmix`) or mpirun (Open MPI
#                        reads the allocation itself)
#   HPCNET_MAX_RESTARTS  restarts inside the allocation by hpcnet.launch (default 2)
#   HPCNET_MAX_REQUEUES  requeues of the job (default 10)
#   HPCNET_LAUNCH_ARGS   more options for hpcnet.launch, split at spaces, e.g.
#                        "--standby off --exclude-failed-hosts" (docs/fault-tolerance.md)
#   HPCNET_RUN_DIR       run directory parent (default runs/<job id>, relative to the
#                        job's working directory, the submission directory by default)
#   HPCNET_ROOT          the hpcnet repository (default: the submission directory)
#   HPCNET_VENV          its Python environment (default <HPCNET_ROOT>/.venv)
#   HPCNET_DEBUG=1       TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=INFO: slower,
#                        names the collective and the ranks on a mismatch or hang
#
# Where things go, per job id (a requeued job keeps its id), relative to the job's
# working directory (the submission directory unless sbatch --chdir):
#   slurm-<job name>-<job id>.out          stdout and stderr, appended across requeues
#   runs/<job id>/<job name>-<UTC time>/   one per start of the job: hpcnet.launch's
#                                          launch.json, and attempt-<k>/ per attempt (rank
#                                          logs, metrics, summary.json, failure.json)
#   runs/<job id>/<job name>.ckpt/         checkpoints, shared by every attempt and
#                                          requeue: each resumes from the newest

hpcnet_log() { echo "hpcnet-job: $(date '+%F %T'): $*" >&2; }

# What a training exit status means for the job: done | requeue | fail.  Restartable
# as hpcnet.launch sees it (75, or killed by SIGABRT, SIGBUS, SIGKILL, SIGSEGV), or
# preempted (76); tests/test_slurm.py keeps the two in step.
hpcnet_verdict() {
    case "$1" in
        0) echo done ;;
        75 | 76 | 134 | 135 | 137 | 139) echo requeue ;;
        *) echo fail ;;
    esac
}

# Stop signals from the start of the job to its end.  --signal=B:USR2@90 signals
# only this shell, and bash runs a trap only once the foreground command has ended:
# the training is waited for in the background to hear the warning in time.  The
# traps are set first thing (without them SIGUSR2 kills the shell: status 140, no
# requeue) and stay to the exit; a SIGUSR2 is held until hpcnet.launch handles it.
hpcnet_stop_pending=0
hpcnet_terminated=0
hpcnet_hold_signals() {
    trap 'hpcnet_log "SIGUSR2: preemption warning, asking the ranks to save and stop"; hpcnet_stop_pending=1' USR2
    # SLURM sends SIGTERM to every process of the job itself; only remember it.
    trap 'hpcnet_terminated=1; hpcnet_log "SIGTERM from SLURM: the ranks save and stop"' TERM
}

# Whether process $1 blocks or catches SIGUSR2 (hpcnet.launch blocks it from its
# first line): sent sooner, while its interpreter starts, the signal would kill it.
hpcnet_handles_usr2() {
    local key mask
    while read -r key mask; do
        case "$key" in
            SigBlk: | SigCgt:) if (( (0x$mask >> 11) & 1 )); then return 0; fi ;;
        esac
    done <"/proc/$1/status" 2>/dev/null
    return 1
}

# Run "$@" in the background and wait for it, passing SIGUSR2 on to it; hpcnet.launch,
# srun and mpirun each pass it on to the ranks.  A stop that came before it started
# starts nothing (status 76: requeue, unless SLURM is ending the job).  Sets hpcnet_status.
hpcnet_supervise() {
    local pid
    if [ "$hpcnet_stop_pending" = 1 ] || [ "$hpcnet_terminated" = 1 ]; then
        hpcnet_log "stopped before the training started: not starting it"
        hpcnet_status=76
        return
    fi
    "$@" &
    pid=$!
    while :; do
        if [ "$hpcnet_stop_pending" = 1 ]; then
            if hpcnet_handles_usr2 "$pid"; then
                hpcnet_stop_pending=0
                kill -USR2 "$pid" 2>/dev/null
            elif kill -0 "$pid" 2>/dev/null; then
                sleep 0.05  # still starting: ask again
                continue
            fi
        fi
        wait "$pid"
        hpcnet_status=$?
        kill -0 "$pid" 2>/dev/null || break  # else the wait was cut short by a signal
    done
}

hpcnet_job() {
    hpcnet_hold_signals
    set -u
    local root="${HPCNET_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
    if [ ! -d "$root/hpcnet" ]; then
        echo "hpcnet-job: $root is not the hpcnet repository: submit from its root or set HPCNET_ROOT" >&2
        exit 2
    fi
    local venv="${HPCNET_VENV:-$root/.venv}"
    if [ -x "$venv/bin/python" ]; then
        export PATH="$venv/bin:$PATH"
    fi
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    if [ "${HPCNET_DEBUG:-0}" = 1 ]; then
        export TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO
    fi

    local job_id="${SLURM_JOB_ID:?not inside a SLURM job: submit with sbatch}"
    local job_name="${SLURM_JOB_NAME:-hpcnet}"
    job_name="${job_name//\//_}"
    local restarts="${SLURM_RESTART_COUNT:-0}" max_requeues="${HPCNET_MAX_REQUEUES:-10}"
    local run_dir="${HPCNET_RUN_DIR:-runs/$job_id}"

    local launcher
    case "${HPCNET_LAUNCHER:-srun}" in
        # --wait: 60 s after the first rank ends, srun ends the others, so a dead
        # rank cannot leave them waiting in a collective for ever (hpcnet's
        # heartbeats usually end the job first).  Not --kill-on-bad-exit: every
        # rank exits 76 (or 2) by itself, a moment apart, and it would kill the
        # later ones as they finish, turning 76 into 143.
        srun) launcher=(srun --mpi=pmix --wait=60) ;;
        mpirun) launcher=(mpirun) ;;
        *) echo "hpcnet-job: HPCNET_LAUNCHER must be srun or mpirun, got '$HPCNET_LAUNCHER'" >&2; exit 2 ;;
    esac
    local defaults=("run.dir=$run_dir" "run.name=$job_name")
    # Each task's share of cores; hpcnet would otherwise divide what it sees by
    # the ranks on the node, too few where SLURM already pins each task.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        defaults+=("train.threads=$SLURM_CPUS_PER_TASK")
    fi
    local launch_args=()
    read -ra launch_args <<<"${HPCNET_LAUNCH_ARGS:-}"
    local command=(python -m hpcnet.launch --max-restarts "${HPCNET_MAX_RESTARTS:-2}" "${launch_args[@]}" --
                   "${launcher[@]}" python -m mpi4py -m hpcnet.train "${defaults[@]}" --resume auto "$@")
    hpcnet_log "job $job_id ($job_name) on ${SLURM_JOB_NODELIST:-?}: ${SLURM_NTASKS:-?} tasks," \
        "requeue $restarts of at most $max_requeues; run dir $run_dir"
    hpcnet_log "running: ${command[*]}"
    hpcnet_supervise "${command[@]}"
    local status=$hpcnet_status verdict
    verdict="$(hpcnet_verdict "$status")"
    hpcnet_log "training exited with status $status ($verdict)"
    if [ "$verdict" = requeue ]; then
        if [ "$hpcnet_terminated" = 1 ]; then
            hpcnet_log "SLURM is ending this job; not requeueing it here"
        elif [ "$restarts" -ge "$max_requeues" ]; then
            hpcnet_log "requeued $restarts times already (HPCNET_MAX_REQUEUES=$max_requeues): giving up"
        else
            hpcnet_log "requeueing job $job_id; it resumes from $run_dir/$job_name.ckpt"
            # Ends this run of the job (SIGTERM to what is left of it) and queues it again.
            scontrol requeue "$job_id" || hpcnet_log "scontrol requeue $job_id failed"
        fi
    fi
    exit "$status"
}
