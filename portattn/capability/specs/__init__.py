"""One support declaration per backend; each file is edited by that backend's owner.

To add a backend: write `specs/<name>.py` defining `SPEC = BackendSpec(...)` whose
`implementation` names its Backend class, add the module to `matrix._SPEC_MODULES` (the
table order) and its name to `matrix.DISPATCH_PRIORITY` (the order dispatch tries them in);
tests/test_dispatch.py keeps the two lists and the classes consistent.
"""
