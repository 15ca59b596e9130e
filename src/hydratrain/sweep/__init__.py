"""A Hydra multirun's own code: the callback that keeps the sweep report and ends the sweep (:mod:`.callback`) and
the checks a sweep makes before it submits (:mod:`.checks`). The report itself is ``hydratrain.sweep_report``; how
the sweeping process ends, ``hydratrain.exits``.

``hydratrain.sweep.SweepReportCallback`` is the ``_target_`` in ``conf/train.yaml`` and in the saved configs of
existing run dirs, so it stays importable from here.
"""
from hydratrain.sweep.callback import SweepReportCallback

__all__ = ["SweepReportCallback"]
