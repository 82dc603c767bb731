"""One support declaration per backend; each file is edited by that backend's owner.

To add a backend: write `specs/<name>.py` defining `SPEC = BackendSpec(...)`
and add its module to `matrix._SPEC_MODULES` (which also fixes the table order).
"""
