#!/bin/bash
# flash-attn's tests/test_flash_attn.py against portattn (bench/conformance/conftest.py says how).
#   bash bench/conformance/run.sh <path to flash-attn's test_flash_attn.py> [out dir]
# The test file is fetched from the flash-attention repository by whoever runs this and
# carried beside the checkout in an ignored folder (.conformance/); it is never committed.
set -o pipefail
source=${1:?path to flash-attn tests/test_flash_attn.py}
out=${2:-${OUT:-/tmp/out}}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
cp "$source" "$work/test_flash_attn.py"
cp "$here/conftest.py" "$work/conftest.py"
export PYTHONPATH=$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
export PORTATTN_CONFORMANCE_OUT=$out
cd "$work" && timeout ${CONFORMANCE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --maxfail=200 test_flash_attn.py 2>&1 | tail -5
