#!/usr/bin/env bash
# Installs the HIP toolchain that compiles portattn's ROCm backend on a CPU-only
# Debian 12 machine: Debian's hipcc 5.2 (gfx90a), clang-19 (gfx942, gfx1100,
# gfx1201, which LLVM 15 does not know; also the host compiler of
# tests/test_rocm_emulated.py) and clang-22 (gfx950, which LLVM 19 does not know;
# bookworm-security ships it), and makes the device-library folder with the
# ISA-version stubs ROCm 5.2 lacks (gfx942, gfx950, gfx1100, gfx1201).
# Idempotent and quiet; about 1.5-2.5 minutes on a fresh machine, ~0.1 s after.
#
# Prints, on its last line, the device-library folder to pass as
# PORTATTN_ROCM_DEVICE_LIB_PATH (build.py also finds it at the default place).
set -euo pipefail

PACKAGES=(hipcc libamdhip64-dev clang-19 lld-19 clang-tools-19 clang-22 lld-22 clang-tools-22 rocm-device-libs)
DEVICE_LIB_DIR="${PORTATTN_ROCM_DEVICE_LIB_PATH:-/usr/local/lib/portattn-amdgcn-bitcode}"
DEBIAN_BITCODE=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  # debconf's "delaying package configuration" notice is noise on minimal images.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null 2> >(grep -v '^debconf: ' >&2)
fi

# ROCm 5.2's device libraries stop at gfx940: give clang the ISA-version stubs
# (gfx target -> __oclc_ISA_version) next to symlinks of everything Debian ships.
STUBS=(942:9402 950:9500 1100:11000 1201:12001)
stub_missing=0
for stub in "${STUBS[@]}"; do
  [ -f "$DEVICE_LIB_DIR/oclc_isa_version_${stub%%:*}.bc" ] || stub_missing=1
done
if [ "$stub_missing" = 1 ]; then
  $SUDO mkdir -p "$DEVICE_LIB_DIR"
  for bc in "$DEBIAN_BITCODE"/*.bc; do
    $SUDO ln -sf "$bc" "$DEVICE_LIB_DIR/$(basename "$bc")"
  done
  stub_dir="$(mktemp -d)"
  for stub in "${STUBS[@]}"; do
    name="${stub%%:*}" version="${stub##*:}"
    cat > "$stub_dir/isa$name.ll" <<IR
target triple = "amdgcn-amd-amdhsa"
@__oclc_ISA_version = linkonce_odr protected local_unnamed_addr addrspace(4) constant i32 $version, align 4
IR
    clang-19 -x ir -c -emit-llvm --target=amdgcn-amd-amdhsa -nogpulib \
      -o "$stub_dir/oclc_isa_version_$name.bc" "$stub_dir/isa$name.ll"
    $SUDO cp "$stub_dir/oclc_isa_version_$name.bc" "$DEVICE_LIB_DIR/"
  done
  rm -rf "$stub_dir"
fi

echo "$DEVICE_LIB_DIR"
