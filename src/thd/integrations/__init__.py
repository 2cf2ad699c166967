"""Integrations with other libraries. Each submodule imports its library on use, so ``import thd``
never needs it: :mod:`thd.integrations.transformers` (``pip install 'thd-kernels[transformers]'``).
"""
