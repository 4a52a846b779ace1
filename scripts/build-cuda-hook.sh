#!/usr/bin/env bash
# Builds the CUDA hook (libs/cuda_hook/build/libgpupool-cuda-hook.so) with the system C
# compiler, and the test doubles the suite runs it against: a fake CUDA driver named like the
# real one (tests/fake_cuda/build/libcuda.so.1) and a C driver client (cuda_program).
# Idempotent: rebuilds only what is older than its source. Installs gcc with apt-get when
# there is no C compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
cc="${CC:-cc}"
if ! command -v "$cc" >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "build-cuda-hook: no C compiler ($cc) and no apt-get to install one" >&2
    exit 1
  fi
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
  cc=gcc
fi
flags=(-O2 -std=c11 -Wall -Wextra -Werror -fPIC)
build() {  # build OUTPUT SOURCE ARGS...
  local out=$1 src=$2; shift 2
  if [ ! -e "$out" ] || [ "$src" -nt "$out" ] || [ "$0" -nt "$out" ]; then
    mkdir -p "$(dirname "$out")"
    "$cc" "${flags[@]}" -o "$out.tmp" "$src" "$@"
    mv "$out.tmp" "$out"
    echo "build-cuda-hook: built $out" >&2
  fi
}
# libdl and libpthread named explicitly: in an image with glibc < 2.34 dlopen, dlvsym and
# pthread_once live there (the source binds them to their oldest symbol versions)
libs=(-ldl -lpthread)
for lib in libdl.so.2 libpthread.so.0; do
  if ! "$cc" -print-file-name="$lib" | grep -q /; then libs=(-ldl -lpthread); break; fi
  libs=(-Wl,--no-as-needed -l:libdl.so.2 -l:libpthread.so.0)
done
build libs/cuda_hook/build/libgpupool-cuda-hook.so libs/cuda_hook/gpupool_cuda_hook.c \
  -shared -Wl,-soname,libgpupool-cuda-hook.so "${libs[@]}"
build tests/fake_cuda/build/libcuda.so.1 tests/fake_cuda/fake_cuda.c -shared -Wl,-soname,libcuda.so.1
build tests/fake_cuda/build/cuda_program tests/fake_cuda/cuda_program.c -ldl
