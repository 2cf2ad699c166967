"""Gluon (Triton's lower level) attention kernels for Hopper (sm_90): ``compat`` binds the names that
differ between Triton versions, ``forward_kernel`` holds the ``@gluon.jit`` forward and ``forward`` its
host wrapper. Importing this package needs neither a GPU nor Gluon; ask
:func:`thd.ops.attention.gluon.compat.gluon_available` before using the kernels."""
