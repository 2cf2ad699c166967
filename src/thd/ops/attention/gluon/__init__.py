"""Gluon (sm_90) attention kernels: Hopper TMA, mbarrier and wgmma beside the tl family."""
