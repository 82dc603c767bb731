"""Runs one of ring-flash-attn's own test scripts (its test/ folder, fetched at run time and
never committed) unchanged on portattn: `torchrun --nproc_per_node N bench/conformance/ring_tests.py
<path to test_x.py>`. The scripts compare the ring functions with a whole-sequence flash-attn
call and print max/mean differences; they assert only their preconditions. Here flash_attn is
portattn (provide_flash_attn) and ring_flash_attn is imported past its HF adapter
(import_ring_flash_attn), so both sides of each comparison run on portattn."""
import os
import runpy
import sys

from portattn.compat import import_ring_flash_attn

script = os.path.abspath(sys.argv[1])
import_ring_flash_attn()
sys.path.insert(0, os.path.dirname(script))
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
