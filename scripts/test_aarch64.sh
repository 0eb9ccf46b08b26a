#!/usr/bin/env bash
# ringllm on aarch64 (64-bit ARM), under qemu user-mode emulation, from an x86-64 machine.
#
#   bash scripts/test_aarch64.sh              # called by scripts/test.sh; run alone as well
#
# 1. qemu-aarch64-static: used if present, else installed with apt-get (root only).
# 2. An aarch64 sysroot holding Debian's python3.11 and the libraries it loads: the arm64 .deb files
#    are fetched with apt-get from the sources this machine already uses and unpacked with dpkg -x
#    (nothing is configured and no maintainer script runs, so no debootstrap and no emulated
#    second stage are needed).
# 3. ringllm's dependencies as aarch64 wheels, fetched by the host's pip (--platform) at the host's
#    installed versions and installed with --target: pip itself never runs emulated. ringllm is the
#    checkout, laid out as setup.py's package_dir maps it (symbolic links).
# 4. tests/cross_arch_fixtures.py makes the inputs that need torch on the host; then pytest runs
#    under emulation: tests/test_aarch64.py and the architecture-independent suites in SUITES.
#
# The sysroot, wheels and the emulated Numba cache live in $RINGLLM_AARCH64_CACHE (default
# ~/.cache/ringllm-aarch64) and are reused while their inputs are unchanged; RINGLLM_AARCH64_THREADS
# (default 2) is the emulated Numba thread count; extra arguments go to the emulated pytest. Skips (exit 0, with the
# reason) where the host is not x86-64, qemu cannot be had, or apt cannot fetch the arm64 packages
# (DEBS names Debian bookworm's); any test failure under emulation fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${RINGLLM_AARCH64_CACHE:-${HOME:-/tmp}/.cache/ringllm-aarch64}
PY=${PYTHON:-python}
# the suites run under emulation, and the cases left out of them (compiling dominates an emulated
# run): the 1-thread twins of each kernel case (the kernels are the 2-thread ones), the bitwise
# few-rows twins, the real-model tensor checks (tests/test_aarch64.py runs the bundled model whole),
# the q8 engine run, the q8 kernels of the types whose integer paths Q4_0, Q8_0, Q4_K already take, and
# the 16-lane matvec kernels (only CPUs with AVX-512 run them; the 8-lane ones run here)
SUITES="tests/test_aarch64.py tests/test_matvec.py tests/test_q8.py tests/test_policies_known_answers.py \
tests/test_kv_store.py tests/test_fast_exp.py"
DESELECT="1thread or few_rows or gemma3_tensors or smollm2_tensors or engine_q8 or Q4_1-avx2 or Q5_0-avx2 or Q6_K-avx2 \
or (lane_kernels and pairs)"
# Debian bookworm packages of python3.11 and what it links (apt-cache depends --recurse, less perl,
# dpkg and the tools nothing here runs); libstdc++6 for llvmlite, libgomp1 for Numba's OpenMP layer
DEBS="gcc-12-base libacl1 libbz2-1.0 libc6 libcom-err2 libcrypt1 libdb5.3 libexpat1 libffi8 libgcc-s1
libgdbm-compat4 libgdbm6 libgomp1 libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 liblzma5
libmd0 libncursesw6 libnsl2 libpcre2-8-0 libpython3.11-minimal libpython3.11-stdlib libreadline8 libselinux1
libsqlite3-0 libssl3 libstdc++6 libtinfo6 libtirpc-common libtirpc3 libuuid1 libzstd1 media-types python3.11
python3.11-minimal readline-common zlib1g"
# distributions installed as aarch64 wheels (at the host's versions); test-only ones at the end
WHEELS="numpy numba llvmlite gguf tokenizers safetensors jinja2 markupsafe tqdm pyyaml requests certifi idna urllib3
charset-normalizer llguidance pytest pluggy iniconfig packaging pygments"

skip() { echo "test_aarch64: SKIPPED: $*"; exit 0; }
say() { echo "test_aarch64: $*"; }

[ "$(uname -m)" = x86_64 ] || skip "the host is $(uname -m), not x86-64"
if ! command -v qemu-aarch64-static > /dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        say "installing qemu-user-static"
        apt-get install -y -q qemu-user-static > /dev/null 2>&1 || skip "apt-get could not install qemu-user-static"
    fi
    command -v qemu-aarch64-static > /dev/null || skip "qemu-aarch64-static is not installed and cannot be (apt-get install qemu-user-static, as root)"
fi
command -v apt-get > /dev/null && command -v dpkg > /dev/null || skip "no apt-get/dpkg to fetch the aarch64 sysroot"

versions=$("$PY" - $WHEELS <<'EOF'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
EOF
) || skip "the host Python lacks one of: $WHEELS (run scripts/test.sh's install first)"
stamp=$(printf '%s\n%s\n' "$DEBS" "$versions" | sha256sum | cut -c1-16)
ROOT=$CACHE/$stamp/root SITE=$CACHE/$stamp/site
mkdir -p "$CACHE"

# one run at a time builds a cache entry: a second waits here, then finds it ready
exec 9> "$CACHE/.lock"
command -v flock > /dev/null && flock 9
if [ ! -e "$CACHE/$stamp/ready" ]; then
    t0=$(date +%s)
    rm -rf "$CACHE/$stamp"
    mkdir -p "$CACHE/$stamp/debs" "$CACHE/$stamp/apt/lists/partial" "$CACHE/$stamp/apt/cache/archives/partial" "$ROOT"
    apt_opts=(-q -oAPT::Architecture=arm64 -oAPT::Architectures=arm64 -oDir::State::Lists="$CACHE/$stamp/apt/lists"
              -oDir::State::Status=/dev/null -oDir::Cache="$CACHE/$stamp/apt/cache" -oDebug::NoLocking=1)
    apt-get "${apt_opts[@]}" update > "$CACHE/$stamp/apt.log" 2>&1 || skip "apt-get update for arm64 failed (see $CACHE/$stamp/apt.log)"
    (cd "$CACHE/$stamp/debs" && apt-get "${apt_opts[@]}" download $DEBS) >> "$CACHE/$stamp/apt.log" 2>&1 \
        || skip "apt-get download of the arm64 packages failed (see $CACHE/$stamp/apt.log)"
    for f in "$CACHE/$stamp"/debs/*.deb; do dpkg -x "$f" "$ROOT"; done
    plat=(--platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 --platform manylinux_2_27_aarch64
          --platform manylinux_2_28_aarch64 --platform manylinux_2_31_aarch64 --only-binary=:all: --python-version 3.11
          --implementation cp)
    "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$CACHE/$stamp/wheels" $versions > "$CACHE/$stamp/pip.log" 2>&1 \
        || { cat "$CACHE/$stamp/pip.log"; echo "test_aarch64: FAILED: pip download of the aarch64 wheels"; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile "${plat[@]}" --target "$SITE" "$CACHE/$stamp"/wheels/*.whl \
        >> "$CACHE/$stamp/pip.log" 2>&1 || { cat "$CACHE/$stamp/pip.log"; echo "test_aarch64: FAILED: pip install --target"; exit 1; }
    touch "$CACHE/$stamp/ready"
    say "sysroot and wheels ready in $(( $(date +%s) - t0 )) s ($CACHE/$stamp)"
fi
exec 9>&-

# ringllm as setup.py lays it out: pyengine/ -> ringllm, models/, runtime/ inside it (native/ is not
# linked: the CPU path never imports it, and its module is built for the host)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/pkg/ringllm"
for f in "$REPO"/pyengine/*; do ln -s "$f" "$WORK/pkg/ringllm/"; done
ln -s "$REPO/models" "$WORK/pkg/ringllm/models"
ln -s "$REPO/runtime" "$WORK/pkg/ringllm/runtime"

t0=$(date +%s)
"$PY" tests/cross_arch_fixtures.py "$WORK/fixtures" > "$WORK/fixtures.log" 2>&1 \
    || { cat "$WORK/fixtures.log"; echo "test_aarch64: FAILED: making the fixtures on the host"; exit 1; }
say "fixtures made on the host in $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
set +e
RINGLLM_CROSS_FIXTURES=$WORK/fixtures NUMBA_CACHE_DIR=$CACHE/$stamp/numba NUMBA_NUM_THREADS=${RINGLLM_AARCH64_THREADS:-2} \
    PYTHONPATH="$WORK/pkg:$SITE:$REPO/tests" PYTHONDONTWRITEBYTECODE=1 \
    qemu-aarch64-static -L "$ROOT" "$ROOT/usr/bin/python3.11" -m pytest -q -p no:cacheprovider -o addopts="" \
    --rootdir "$REPO" --durations=15 -k "not ($DESELECT)" $SUITES "$@"
rc=$?
set -e
say "pytest under aarch64 emulation: exit $rc in $(( $(date +%s) - t0 )) s"
exit $rc
