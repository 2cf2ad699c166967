"""What every op runs on: settings (:mod:`.config`), kernel launches (:mod:`.launcher`), the
attention tile policy (:mod:`.tiles`) and the choice of implementation (:mod:`.families`).

Imports nothing of ``thd.ops``; ``config`` and ``families`` import without Triton.
"""
