"""The Triton kernels, one op to a module (``store_kv.store_kv``, ...), gathered into
the op set ``TRITON_OPS`` by ``op_set.py``.

Importing this package defines no kernel and imports no triton: a kernel is defined
when its module is imported; to run them on the CPU through the Triton interpreter,
set TRITON_INTERPRET=1 before that import.
"""
