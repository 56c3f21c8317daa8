#!/usr/bin/env bash
# The GPU check: what one real GPU says about pytest-vram, in under 8 minutes on a bare machine
# with no package index. docs/gpu.md says what each stage shows.
#
#   bash scripts/gpu-check.sh --prepare            # with an index: build the wheels into .whl/
#   bash scripts/gpu-check.sh [OUT_DIR]            # on the GPU machine (OUT_DIR: default $OUT)
#   bash scripts/gpu-check.sh --dry-run [OUT_DIR]  # the same stages on this machine's CPU
#
# Stages: device, install, cuda-tests, suites-cuda, overhead, oom, snapshot, suites-sim, ratios,
# outputs; each runs under `timeout`, and the script exits 1 when any did not pass. OUT_DIR
# must be empty; the check leaves at most 8 files there, summary.txt first among them.
#
# Environment:
#   PYTHON                    the interpreter that has torch (default python3)
#   GPU_CHECK_WHEELS          where --prepare puts the wheels and the check installs them from
#                             (default .whl/ in the repository)
#   GPU_CHECK_BUDGET          seconds for all stages together (default 460: 8 minutes in all)
#   GPU_CHECK_TIMEOUT_<STAGE> one stage's limit in seconds, e.g. GPU_CHECK_TIMEOUT_CUDA_TESTS=60
#   GPU_CHECK_SUITES          the reference suites to run (default suites/; in the dry run
#                             the three parameter-count tests of suites/test_estimate_budget.py)
#   GPU_CHECK_OVERHEAD_TESTS  small tests in the overhead stage (default 200; dry run 40)
# shellcheck disable=SC2329  # the stage_* functions run through --stage NAME
set -uo pipefail
export LC_ALL=C
root=$(cd "$(dirname "$0")/.." && pwd)
self="$root/scripts/gpu-check.sh"
cd "$root" || exit 2

STAGES=(device install cuda-tests suites-cuda overhead oom snapshot suites-sim ratios outputs)
declare -A LIMIT=(
    [device]=30 [install]=60 [cuda-tests]=90 [suites-cuda]=120 [overhead]=60 [oom]=45
    [snapshot]=45 [suites-sim]=240 [ratios]=20 [outputs]=10
)
# How many of a stage's last lines the summary repeats (five when the stage did not pass);
# the stages not listed here are repeated whole.
declare -A SUMMARY_LINES=([cuda-tests]=1 [suites-cuda]=1 [suites-sim]=1 [oom]=3)
# The files the stages leave in OUT_DIR; summary.txt comes last.
OUTPUTS=(gpu-check.log cuda.json cuda.xml sim.json snapshot.pickle memory-viz.html summary.txt)
MAX_OUTPUTS=8
DRY_RUN_SUITES=suites/test_training.py::test_idle_memory_is_the_weights

usage() {
    sed -n '2,/^# shellcheck/p' "$self" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

now_ms() {
    local t=${EPOCHREALTIME/./}
    echo $((t / 1000))
}

seconds() {  # milliseconds as seconds with one decimal
    printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100))
}

# --- --prepare: the wheels the bare machine installs, built here -------------------------------

prepare() {
    local py=${PYTHON:-python3} wheels=${GPU_CHECK_WHEELS:-$root/.whl} src isolation=() version
    local needed
    src=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-src.XXXXXX")
    # Built from a copy: an in-tree build reuses build/, whose stale files would enter the wheel.
    tar -C "$root" --exclude=__pycache__ -cf - pyproject.toml README.md pytest_vram |
        tar -C "$src" -xf - || { rm -rf "$src"; return 1; }
    # The setuptools already here, rather than one fetched into an isolated build environment,
    # when it is as new as pyproject.toml requires: an older one (Python 3.10's and 3.11's
    # ensurepip bring 65) rejects the SPDX license string.
    needed=$(sed -n 's/^requires = \["setuptools>=\([0-9]*\).*/\1/p' "$root/pyproject.toml")
    if "$py" -c "import setuptools as s, sys; sys.exit(int(s.__version__.split('.')[0])<$needed)" \
        2>/dev/null; then
        isolation=(--no-build-isolation)
    fi
    mkdir -p "$wheels" && rm -f "$wheels"/*.whl
    "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps "${isolation[@]}" \
        --wheel-dir "$wheels" "$src" || { rm -rf "$src"; return 1; }
    rm -rf "$src"
    # The one requirement the GPU image lacks (docs/gpu.md); the version tested here.
    version=$("$py" -c 'from importlib.metadata import version; print(version("junitparser"))' \
        2>/dev/null)
    "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheels" \
        "junitparser${version:+==$version}" || return 1
    ls -l "$wheels"
}

# --- the stages, each run as `bash gpu-check.sh --stage NAME` under timeout ---------------------

stage_device() {
    local failed=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used \
            --format=csv || failed=1
        # The CUDA version the driver supports; only nvidia-smi's header and -q report it.
        nvidia-smi -q | grep -E '^(Driver Version|CUDA Version)' || true
    elif [[ $GC_MODE == dry ]]; then
        echo "nvidia-smi: not on this machine"
    else
        echo "nvidia-smi: not found" >&2
        failed=1
    fi
    "$GC_PYTHON" - "$GC_MODE" <<'PY' || failed=1
import platform
import sys

try:
    import torch
except ImportError as exc:
    sys.exit(f"{sys.executable}: torch does not import: {exc}")

print("python", platform.python_version(), "torch", torch.__version__,
      "built for CUDA", torch.version.cuda)
if torch.cuda.is_available():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    print(f"device {index} of {torch.cuda.device_count()}: {props.name}, "
          f"{props.total_memory} bytes ({props.total_memory / 2**30:.2f} GiB), "
          f"compute capability {props.major}.{props.minor}")
    try:
        import pynvml

        pynvml.nvmlInit()
        print("NVML: driver", pynvml.nvmlSystemGetDriverVersion(),
              "NVML", pynvml.nvmlSystemGetNVMLVersion(),
              "CUDA driver API", pynvml.nvmlSystemGetCudaDriverVersion())
    except Exception as exc:  # pynvml's errors have no common base worth naming here
        print("NVML: unavailable:", exc)
elif sys.argv[1] == "dry":
    print("no CUDA device: dry run")
else:
    sys.exit("torch sees no CUDA device")
PY
    return "$failed"
}

stage_install() {
    local parent flags=(--without-pip) site wheel
    local wheels=("$GC_WHEELS"/pytest_vram-*.whl "$GC_WHEELS"/junitparser-*.whl)
    for wheel in "${wheels[@]}"; do
        if [[ ! -f $wheel ]]; then
            echo "$wheel: no such wheel; run bash scripts/gpu-check.sh --prepare first" >&2
            return 1
        fi
    done
    # The new environment sees what $PYTHON sees (torch above all): the system's packages, or,
    # when $PYTHON is itself a virtual environment's, that environment's.
    parent=$("$GC_PYTHON" -c 'import sys; print(sys.prefix * (sys.prefix != sys.base_prefix))')
    if [[ -z $parent ]] || grep -qi '^include-system-site-packages *= *true' "$parent/pyvenv.cfg"
    then
        flags+=(--system-site-packages)
    fi
    "$GC_PYTHON" -m venv "${flags[@]}" "$GC_VENV" || return 1
    if [[ -n $parent ]]; then
        site=$("$GC_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$GC_PYTHON" -c 'import sysconfig; print(*sorted(set(sysconfig.get_paths()[k]
            for k in ("purelib", "platlib"))), sep="\n")' >"$site/gpu-check-parent.pth"
        echo "environment: $GC_VENV on top of $parent"
    else
        echo "environment: $GC_VENV with the system site-packages of $GC_PYTHON"
    fi
    if "$GC_VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        # --ignore-installed: into this environment even where the parent has the same version.
        "$GC_VENV/bin/python" -m pip install --no-index --no-deps --ignore-installed \
            --disable-pip-version-check --no-warn-script-location --quiet "${wheels[@]}" ||
            return 1
        echo "installed with pip --no-index --no-deps: ${wheels[*]##*/}"
    else
        "$GC_VENV/bin/python" scripts/gpu_check_install.py unpack "${wheels[@]}" || return 1
    fi
    "$GC_VENV/bin/python" scripts/gpu_check_install.py verify --checkout "$root"
}

# pytest from the virtual environment, with the checkout kept off sys.path (PYTHONSAFEPATH):
# the plugin must come from the installed wheel.
venv_pytest() {
    PYTHONSAFEPATH=1 "$GC_VENV/bin/python" -m pytest -p no:cacheprovider -p no:randomly "$@"
}

stage_cuda_tests() {
    local log="$GC_WORK/cuda-tests.pytest"
    venv_pytest tests/test_cuda_real.py -v -rs | tee "$log"
    local rc=${PIPESTATUS[0]}
    ((rc == 0)) || return "$rc"
    # On the GPU these tests must run: a skip means torch saw no device.
    if [[ $GC_MODE == run ]] && tail -n 1 "$log" | grep -q skipped; then
        echo "cuda tests were skipped on the GPU machine" >&2
        return 1
    fi
}

stage_suites_cuda() {
    # Only the tests that run on the backend asked for: those a marker pins (the simulated
    # 32B suites) run once, in the sim stage.
    # shellcheck disable=SC2086  # GC_SUITES is a list of paths
    venv_pytest $GC_SUITES -m "not vram_backend" --vram-backend="$GC_BACKEND" --vram-report \
        --vram-sim-host-tensors=host --vram-json "$GC_OUT/cuda.json" --junitxml "$GC_OUT/cuda.xml"
}

stage_suites_sim() {
    # Host tensors stay on the host, as on the GPU the figures are compared with.
    # shellcheck disable=SC2086
    venv_pytest $GC_SUITES --vram-backend=sim --vram-report --vram-sim-host-tensors=host \
        --vram-json "$GC_OUT/sim.json"
}

stage_ratios() {
    "$GC_VENV/bin/python" scripts/sim_vs_cuda.py "$GC_OUT/sim.json" "$GC_OUT/cuda.json" \
        --backend "$GC_BACKEND"
}

stage_overhead() {
    "$GC_VENV/bin/python" scripts/gpu_check_overhead.py --backend "$GC_BACKEND" \
        --device "$GC_DEVICE" --tests "$GC_OVERHEAD_TESTS" --workdir "$GC_WORK/overhead"
}

stage_oom() {
    "$GC_VENV/bin/python" scripts/gpu_check_oom.py --backend "$GC_BACKEND" \
        --workdir "$GC_WORK/oom"
}

stage_snapshot() {
    "$GC_VENV/bin/python" scripts/gpu_check_snapshot.py --backend "$GC_BACKEND" \
        --workdir "$GC_WORK/snapshot" --out "$GC_OUT"
}

stage_outputs() {
    local failed=0 name count path
    for name in "${OUTPUTS[@]}"; do
        [[ $name == summary.txt ]] && continue  # written after this stage
        if [[ -s $GC_OUT/$name ]]; then
            printf '%-18s %10d bytes\n' "$name" "$(stat -c %s "$GC_OUT/$name")"
        else
            echo "$name: missing or empty" >&2
            failed=1
        fi
    done
    # What the device machine brings back: at most 8 plain files, plainly named, no folders.
    count=1  # summary.txt
    while IFS= read -r -d '' path; do
        name=${path#"$GC_OUT"/}
        [[ $name == summary.txt ]] && continue
        count=$((count + 1))
        if [[ ! -f $path || -L $path || ! $name =~ ^[A-Za-z0-9._-]+$ ]]; then
            echo "$name: not a plainly named file" >&2
            failed=1
        fi
    done < <(find "$GC_OUT" -mindepth 1 -print0)
    echo "$count files in $GC_OUT with summary.txt (at most $MAX_OUTPUTS)"
    if ((count > MAX_OUTPUTS)); then
        echo "more than $MAX_OUTPUTS files" >&2
        failed=1
    fi
    return "$failed"
}

# --- the run ------------------------------------------------------------------------------------

declare -A STATUS ELAPSED LIMITS

run_stage() {
    local name=$1 limit=${LIMIT[$1]} override remaining started rc
    override=GPU_CHECK_TIMEOUT_${name^^}
    override=${override//-/_}
    remaining=$(((deadline - $(now_ms)) / 1000))
    if [[ -n ${!override:-} ]]; then
        limit=${!override}
        if [[ ! $limit =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
            STATUS[$name]="not run: $override=$limit is not seconds"
        fi
    elif ((remaining < limit)); then
        limit=$remaining
        if [[ $name == outputs ]]; then
            ((limit > 0)) || limit=1  # the last stage runs whatever is left
        elif ((limit <= 0)); then
            STATUS[$name]="not run: the ${budget} s budget is spent"
        fi
    fi
    printf '\n== %s (limit %s s)\n' "$name" "$limit" | tee -a "$log"
    if [[ ! $name =~ ^(device|install|outputs)$ && ${STATUS[install]} != ok ]]; then
        STATUS[$name]="not run: the install failed"
    fi
    if [[ -n ${STATUS[$name]:-} ]]; then
        echo "${STATUS[$name]}" | tee -a "$log"
        ELAPSED[$name]=0.0
        return
    fi
    started=$(now_ms)
    timeout --kill-after=5 "$limit" bash "$self" --stage "$name" </dev/null 2>&1 |
        tee -a "$log" "$GC_WORK/$name.out"
    rc=${PIPESTATUS[0]}
    ELAPSED[$name]=$(seconds $(($(now_ms) - started)))
    case $rc in
        0) STATUS[$name]=ok ;;
        124 | 137) STATUS[$name]="timed out after $limit s" ;;
        *) STATUS[$name]="failed (exit $rc)" ;;
    esac
    LIMITS[$name]=$limit
}

write_summary() {
    local name lines failed=() total=$1 commit
    commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo "unknown")
    for name in "${STAGES[@]}"; do
        [[ ${STATUS[$name]} == ok ]] || failed+=("$name")
    done
    {
        if ((${#failed[@]} == 0)); then
            echo "pytest-vram GPU check: all ${#STAGES[@]} stages passed"
        else
            echo "pytest-vram GPU check: ${#failed[@]} of ${#STAGES[@]} stages did not pass:" \
                "${failed[*]}"
        fi
        [[ $GC_MODE == dry ]] && echo "dry run: cuda stages ran on sim"
        echo "commit $commit, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "total wall time: $(seconds "$total") s (budget $budget s)"
        echo
        printf '%-12s %-40s %9s %7s\n' stage status seconds limit
        for name in "${STAGES[@]}"; do
            printf '%-12s %-40s %9s %7s\n' "$name" "${STATUS[$name]}" "${ELAPSED[$name]}" \
                "${LIMITS[$name]:--}"
        done
        for name in "${STAGES[@]}"; do
            [[ -f $GC_WORK/$name.out ]] || continue
            lines=${SUMMARY_LINES[$name]:-0}
            if ((lines > 0)) && [[ ${STATUS[$name]} != ok ]] && ((lines < 5)); then lines=5; fi
            printf '\n== %s\n' "$name"
            if ((lines > 0)); then
                tail -n "$lines" "$GC_WORK/$name.out"
            else
                cat "$GC_WORK/$name.out"
            fi
        done
    } >"$GC_OUT/summary.txt"
    ((${#failed[@]} == 0))
}

main() {
    local mode=run out="" started
    while (($#)); do
        case $1 in
            --prepare) prepare; exit ;;
            --dry-run) mode=dry ;;
            --stage) shift; "stage_${1//-/_}"; exit ;;
            -h | --help) usage ;;
            -*) echo "gpu-check: unknown option $1" >&2; usage ;;
            *) out=$1 ;;
        esac
        shift
    done
    out=${out:-${OUT:-}}
    if [[ -z $out ]]; then
        out=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
    elif [[ -n $(ls -A "$out" 2>/dev/null) ]]; then
        echo "gpu-check: $out is not empty: the check writes its files into an empty folder" >&2
        exit 2
    fi
    mkdir -p "$out" || exit 2
    budget=${GPU_CHECK_BUDGET:-460}
    if [[ ! $budget =~ ^[0-9]+$ ]]; then
        echo "gpu-check: GPU_CHECK_BUDGET=$budget: expected whole seconds" >&2
        exit 2
    fi
    GC_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work.XXXXXX") || exit 2
    trap 'rm -rf "$GC_WORK"' EXIT
    GC_OUT=$(cd "$out" && pwd)
    export GC_MODE=$mode GC_OUT GC_WORK GC_VENV="$GC_WORK/venv" GC_PYTHON=${PYTHON:-python3}
    export GC_WHEELS=${GPU_CHECK_WHEELS:-$root/.whl}
    if [[ $mode == dry ]]; then
        # No GPU here: what runs on cuda runs on sim, on a few quick suite tests (a shared CPU
        # runner can take minutes over a training suite) and fewer small tests.
        export GC_BACKEND=sim GC_DEVICE=cpu
        export GC_SUITES=${GPU_CHECK_SUITES:-$DRY_RUN_SUITES}
        export GC_OVERHEAD_TESTS=${GPU_CHECK_OVERHEAD_TESTS:-40}
    else
        export GC_BACKEND=cuda GC_DEVICE=cuda GC_SUITES=${GPU_CHECK_SUITES:-suites}
        export GC_OVERHEAD_TESTS=${GPU_CHECK_OVERHEAD_TESTS:-200}
    fi
    export PYTHONUNBUFFERED=1
    log="$GC_OUT/gpu-check.log"
    started=$(now_ms)
    deadline=$((started + budget * 1000))
    {
        echo "pytest-vram GPU check ($mode) into $GC_OUT"
        [[ $mode == dry ]] && echo "dry run: cuda stages ran on sim"
    } | tee "$log"
    STATUS[install]=""
    for name in "${STAGES[@]}"; do
        run_stage "$name"
    done
    write_summary "$(($(now_ms) - started))"
    local rc=$?
    printf '\n' && cat "$GC_OUT/summary.txt"
    exit $rc
}

main "$@"
