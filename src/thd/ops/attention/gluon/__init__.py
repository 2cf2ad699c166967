"""Gluon (Triton's lower level) attention kernels for Hopper (sm_90), beside the tl family.

``compat`` binds the names that differ between Triton versions; ``schedule`` builds the forward's
work list; ``forward_kernel`` / ``forward`` and ``backward_kernel`` / ``backward`` hold the
``@gluon.jit`` kernels and their host wrappers. Importing this package needs neither a GPU nor
Gluon; ask :func:`thd.ops.attention.gluon.compat.gluon_available` before using the kernels.
"""
