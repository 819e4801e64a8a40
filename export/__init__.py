"""Export: a model directory (and its adapter) as a phone-ready bundle.

bundle.py writes and checks bundles; manifest.py is their format; graphs.py the step graphs; eager.py
the eager backend (the reference) and the driver of any backend; parity.py the parity check; target.py the
target interface; executorch_target.py, qnn_target.py and qaihub_target.py the targets;
session.py opens a model directory or a bundle as a runner; report.py the export report (docs/export.md).
"""
