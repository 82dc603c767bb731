#!/bin/bash
# flash-attn-4 on an offline GPU machine, for benchmarking only (never a portattn dependency).
# With network access, `pip install flash-attn-4` does the same. Where the machine has no
# network and each transfer carries at most 64 MiB (the working tree included, ~14 MiB), the
# wheels travel in three transfers of ~33 MiB each, which leaves room for a library in the
# same transfer, and are joined on the machine:
#
#   On the dev machine (once; /.whl/ is in .git/info/exclude):
#     .whl/a: flash_attn_4, quack_kernels, torch_c_dlpack_ext, nvidia_cutlass_dsl,
#             nvidia_cutlass_dsl_libs_core and nvidia_cutlass_dsl_libs_cu13-*.whl.part00
#     .whl/b: nvidia_cutlass_dsl_libs_base and nvidia_cutlass_dsl_libs_cu13-*.whl.part01
#     .whl/c: apache_tvm_ffi and nvidia_cutlass_dsl_libs_cu13-*.whl.part02
#     (the 92 MB cu13 wheel cut by `split -n 3 -d WHEEL WHEEL.part`)
#   First and second transfer, carrying [".whl/a", <library>] then [".whl/b"]:
#     bash bench/tools/fa4_stage.sh stash .whl/a; <other work>
#   Third transfer (back to back, while the machine is warm), carrying [".whl/c"]:
#     bash bench/tools/fa4_stage.sh stash .whl/c && eval "$(bash bench/tools/fa4_stage.sh install)" && bash bench/run_all.sh bench ...
#
# Verbs:
#   stash DIR  copy DIR's files into /tmp/fa4parts (survives between calls on a warm machine)
#   install    join the .partNN pieces, test every wheel (python3 -m zipfile -t), install
#              them with pip --no-index --no-deps --target /tmp/site, check the import;
#              stdout is only the line to eval: the PYTHONPATH export (a --target install
#              skips the cutlass DSL's .pth file, hence its dsl_packages folder on the path).
#              On any failure it prints PORTATTN_FA4_MISSING=<why> instead and exits 1: the
#              benchmark then shows flash-attn-4 as n/a with that reason.
set -o pipefail
PARTS=${FA4_PARTS:-/tmp/fa4parts}
SITE=${FA4_SITE:-/tmp/site}
# The wheels the benchmark needs (flash-attn-4 4.0.0b36 and its runtime closure, minus what
# the device already has: torch, cuda-bindings, protobuf, einops, typing-extensions).
WANTED="flash_attn_4-4.0.0b36 nvidia_cutlass_dsl-4.8.1 nvidia_cutlass_dsl_libs_base-4.8.1
nvidia_cutlass_dsl_libs_core-4.8.1 nvidia_cutlass_dsl_libs_cu13-4.8.1 quack_kernels apache_tvm_ffi torch_c_dlpack_ext"

log() { echo "fa4_stage: $*" >&2; }

missing() {  # the eval-able failure line, a reason the benchmark can show
  log "$1"
  printf 'export PORTATTN_FA4_MISSING=%q\n' "$1"
  exit 1
}

stash() {
  local dir=$1
  [ -d "$dir" ] || { log "no folder $dir (was it in the call's carry list?)"; exit 1; }
  mkdir -p "$PARTS" && cp -f "$dir"/* "$PARTS"/ || { log "copy of $dir into $PARTS failed"; exit 1; }
  log "stashed $(ls "$dir" | wc -l) files from $dir; $PARTS now holds: $(ls "$PARTS" | tr '\n' ' ')"
}

install() {
  [ -d "$PARTS" ] || missing "nothing stashed in $PARTS (run 'stash .whl/a' and 'stash .whl/b' on the same warm machine)"
  local first whole
  for first in "$PARTS"/*.part00; do
    [ -e "$first" ] || continue
    whole=${first%.part00}
    ls "$whole".part* >/dev/null 2>&1 || continue
    if [ "$(ls "$whole".part* | wc -l)" -lt 2 ]; then
      missing "only one half of $(basename "$whole") is in $PARTS (stash both .whl/a and .whl/b)"
    fi
    cat $(ls "$whole".part* | sort) > "$whole" || missing "could not join $(basename "$whole")"
  done
  local wheel name
  for name in $WANTED; do
    ls "$PARTS/$name"-*.whl >/dev/null 2>&1 || missing "wheel $name is missing from $PARTS"
  done
  local tested
  for wheel in "$PARTS"/*.whl; do
    # zipfile -t exits 0 on a CRC mismatch (it only prints it), 1 on a broken archive.
    tested=$(python3 -m zipfile -t "$wheel" 2>&1)
    if [ $? -ne 0 ] || grep -q corrupted <<< "$tested"; then
      missing "$(basename "$wheel") is corrupt (zipfile -t: $(echo "$tested" | tail -1))"
    fi
  done
  if python3 -m pip --version >/dev/null 2>&1; then
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
      --upgrade --target "$SITE" "$PARTS"/*.whl >&2 \
      || missing "pip install --target $SITE failed"
  else
    # No pip on the device: these wheels carry no .data folders, so unpacking them is the
    # install the benchmark needs (dist-info included, for importlib.metadata; only the
    # console-script launchers, which nothing here runs, are not made).
    log "no pip for $(python3 -V 2>&1); unpacking the wheels into $SITE"
    for wheel in "$PARTS"/*.whl; do
      python3 -m zipfile -e "$wheel" "$SITE" || missing "unpacking $(basename "$wheel") failed"
    done
  fi
  local path="$SITE/nvidia_cutlass_dsl/dsl_packages:$SITE"
  local check
  if check=$(PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      'from flash_attn.cute import flash_attn_func; import importlib.metadata as m; print(m.version("flash-attn-4"))' 2>&1); then
    log "flash-attn-4 $check imports from $SITE"
  else
    log "installed in $SITE, but the import fails (the benchmark will say why): $(echo "$check" | tail -1)"
  fi
  echo "export PYTHONPATH=$path\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "$1" in
  stash) [ $# -eq 2 ] || { log "usage: $0 stash DIR"; exit 2; }; stash "$2" ;;
  install) install ;;
  *) log "usage: $0 stash DIR | install"; exit 2 ;;
esac
